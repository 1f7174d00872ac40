"""Text sequences over the tts service with in-process codec lanes (CPU, tiny random-weight
checkpoint): what the `tts` model does with the pieces of a Triton sequence, without a server."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from sinks import CollectingSink
from test_tts_service import (
    assert_audio_is_the_whole_decode,
    cpu_codec,
    engine_and_parser,
    wait_for,
)

from voxtriton.errors import RequestError
from voxtriton.models.config import load_config
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.scheduler.policy import BACKGROUND, URGENT
from voxtriton.serving.codec_service import InProcessLane
from voxtriton.serving.requests import RequestParser
from voxtriton.serving.sequences import TextSequences
from voxtriton.serving.settings import TTSSettings
from voxtriton.serving.tts_service import TTSService

TEXT = "Pieces of a sentence, spoken as they come."
IDLE_S = 0.3


def text(value: str) -> dict:
    return {"text": np.array([value.encode()], dtype=object)}


FIRST = {"max_frames": np.array([16]), "ignore_eos": np.array([True]), "seed": np.array([4])}


@contextlib.contextmanager
def text_sequences(
    tiny_checkpoint,
    policy: str,
    idle_s: float,
    expire_every_s: float | None = None,
    max_open_s: float = 600.0,
    **scheduler,
):
    """TextSequences over a tts service with in-process CPU codec lanes, the tiny checkpoint's engine
    and its interleaved-layout parser; yields (parser, service, sequences, codec)."""
    engine, _, scheduler_config = engine_and_parser(tiny_checkpoint, policy, **scheduler)
    config = load_config(tiny_checkpoint)
    settings = TTSSettings(checkpoint_dir=str(tiny_checkpoint), text_layout="interleaved", max_positions=256)
    parser = RequestParser(config, PromptBuilder(config, TextTokenizer(tiny_checkpoint)), settings)
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    sequences = TextSequences(parser, service, idle_s, interval_s=expire_every_s, max_open_s=max_open_s)
    try:
        yield parser, service, sequences, codec
    finally:
        sequences.shutdown()
        service.shutdown()


@pytest.fixture()
def served(tiny_checkpoint):
    # Idle sequences are expired by hand below.
    served = text_sequences(tiny_checkpoint, "concurrent", IDLE_S, expire_every_s=3600, chunk_schedule="2,4")
    with served as (parser, service, sequences, _):
        yield parser, service, sequences


def test_pieces_give_the_codes_of_the_whole_text(served):
    parser, service, sequences = served
    whole = CollectingSink()
    service.submit(parser.parse("whole", {**text(TEXT), **FIRST}), whole)
    assert whole.done.wait(120) and not whole.errors
    streamed = CollectingSink()
    words = TEXT.split(" ")
    sequences.piece("7", True, False, {**text(words[0]), **FIRST}, "s#0", lambda: streamed)
    for index, word in enumerate(words[1:], 1):
        time.sleep(0.05)
        sequences.piece("7", False, index == len(words) - 1, text(" " + word), f"s#{index}", None)
    assert streamed.done.wait(120) and not streamed.errors
    np.testing.assert_array_equal(np.concatenate(streamed.codes), np.concatenate(whole.codes))
    assert not sequences.open and sequences.ended["7"] == "its last piece arrived"


def test_bad_pieces_are_refused_and_name_the_sequence(served):
    _, _, sequences = served
    with pytest.raises(RequestError, match="unknown sequence 9: its first piece must carry sequence_start"):
        sequences.piece("9", False, False, text("x"), "a", None)
    sink = CollectingSink()
    sequences.piece("9", True, False, {**text("Hello there, "), **FIRST}, "b", lambda: sink)
    with pytest.raises(RequestError, match="sequence 9 is already open"):
        sequences.piece("9", True, False, text("again"), "c", lambda: CollectingSink())
    sequences.piece("9", False, True, text("done."), "d", None)
    with pytest.raises(RequestError, match=r"sequence 9 has ended \(its last piece arrived\)"):
        sequences.piece("9", False, False, text("more"), "e", None)
    assert sink.done.wait(120) and not sink.errors


def test_an_idle_sequence_ends_with_an_error_and_frees_its_row(served):
    _, service, sequences = served
    sink = CollectingSink()
    sequences.piece("5", True, False, {**text("Hello there, and then "), **FIRST}, "a", lambda: sink)
    for _ in range(3):  # empty pieces do not keep it open
        time.sleep(IDLE_S / 2)
        sequences.piece("5", False, False, text(""), "k", None)
    sequences.expire()
    assert sink.done.wait(10) and sink.errors[0].startswith(
        "text: sequence 5 had no text piece for 0.3 s (text_idle_timeout_s); mark its last piece as its end"
    )
    assert sequences.ended["5"] == "timed out"
    wait_for(lambda: not service.streams and not service.engine.running)


def test_a_bad_later_piece_ends_its_sequence_with_its_error(served):
    """Not only the piece is refused: its text would be missing from the audio, and an end it
    carried lost, the stream left to wait for the idle timeout."""
    _, service, sequences = served
    sink = CollectingSink()
    sequences.piece("4", True, False, {**text("Hello there, and then "), **FIRST}, "a", lambda: sink)
    bad_last = {"text": np.array([b"the end\xff."], dtype=object)}
    with pytest.raises(RequestError, match="text: not valid UTF-8"):
        sequences.piece("4", False, True, bad_last, "b", None)
    assert sink.done.wait(10) and sink.errors[0].startswith("text: not valid UTF-8")
    assert sequences.ended["4"].startswith("failed: text: not valid UTF-8")
    wait_for(lambda: not service.streams and not service.engine.running)


def test_a_later_piece_with_options_ends_its_sequence_and_a_refused_start_is_named(served):
    """A later piece carries text alone: options there were dropped unseen, a bad value among them.
    The pieces after a refused first piece are told it was refused, not that none started."""
    _, service, sequences = served
    sink = CollectingSink()
    sequences.piece("6", True, False, {**text("Hello there, and then "), **FIRST}, "a", lambda: sink)
    with pytest.raises(
        RequestError, match="max_frames: sequence 6: only a sequence's first piece takes options"
    ):
        sequences.piece("6", False, True, {**text("the end."), "max_frames": np.array([-1])}, "b", None)
    assert sink.done.wait(10) and sink.errors[0].startswith("max_frames: sequence 6: only")
    with pytest.raises(RequestError, match="max_frames: must be between 1 and"):
        sequences.piece("8", True, False, {**text("Hi, "), "max_frames": np.array([-1])}, "c", CollectingSink)
    with pytest.raises(
        RequestError, match=r"sequence 8 has ended \(its first piece was refused: max_frames: must be between"
    ):
        sequences.piece("8", False, True, text("there."), "d", None)
    wait_for(lambda: not service.streams and not service.engine.running)


class GoneSink(CollectingSink):
    """A client gone before its error: sending it raises, as Triton's response sender does."""

    def fail(self, message):
        super().fail(message)
        raise RuntimeError("the response sender is closed")


def test_an_error_that_cannot_be_sent_does_not_stop_the_timeouts(tiny_checkpoint):
    """Sequence 1 timed out before its first word settled (its sink is the first piece's, and its
    client is gone); sequence 2, submitted and paused for text, still times out and frees its row."""
    served = text_sequences(tiny_checkpoint, "concurrent", IDLE_S, expire_every_s=0.05)
    with served as (_, service, sequences, _):
        gone, paused = GoneSink(), CollectingSink()
        sequences.piece("1", True, False, {**text("Hello"), **FIRST}, "a", lambda: gone)
        assert not sequences.open["1"].submitted
        time.sleep(IDLE_S / 2)
        sequences.piece("2", True, False, {**text("Hello there, and then "), **FIRST}, "b", lambda: paused)
        assert gone.done.wait(10) and "sequence 1 had no text piece" in gone.errors[0]
        assert paused.done.wait(10) and "sequence 2 had no text piece" in paused.errors[0]
        assert sequences.thread.is_alive()
        wait_for(lambda: not service.streams and not service.engine.running)


def test_a_sequence_open_too_long_ends_with_an_error_however_its_text_comes(tiny_checkpoint):
    """A word's characters, one a piece, well within the idle time each: the sequence still ends
    once open `max_open_s` (`text_stream_max_s`), with an error, and frees its row."""
    served = text_sequences(tiny_checkpoint, "concurrent", IDLE_S, expire_every_s=3600, max_open_s=0.6)
    with served as (_, service, sequences, _):
        sink = CollectingSink()
        sequences.piece("6", True, False, {**text("Hello there, and then a"), **FIRST}, "a", lambda: sink)
        for _ in range(8):  # 1.2 s, a piece every 0.15 s
            time.sleep(IDLE_S / 2)
            sequences.expire()
            if sink.done.is_set():
                break
            sequences.piece("6", False, False, text("a"), "k", None)
        assert sink.done.wait(10) and "was open for more than 0.6 s (text_stream_max_s)" in sink.errors[0]
        assert sequences.ended["6"] == "timed out"
        wait_for(lambda: not service.streams and not service.engine.running)


def test_a_sequence_whose_stream_ended_frees_its_id(served):
    """A stream ended without its sequence (a client's cancel, a failure) closes the sequence at its
    next piece or sweep: its id may start again at once, and a piece for the old one is refused."""
    parser, service, sequences = served
    first = CollectingSink()
    sequences.piece("3", True, False, {**text("Hello there, and then "), **FIRST}, "a", lambda: first)
    service.end_stream("a", "cancelled by the client")  # what the cancellation watcher does
    assert first.done.wait(10) and "cancelled by the client" in first.errors[0]
    again = CollectingSink()
    sequences.piece("3", True, True, {**text("Hello again."), **FIRST}, "b", lambda: again)
    assert again.done.wait(120) and not again.errors
    sequences.piece(
        "4", True, False, {**text("Hello there, and then "), **FIRST}, "c", lambda: CollectingSink()
    )
    service.end_stream("c", "failed")
    sequences.expire()
    assert "4" not in sequences.open and sequences.ended["4"] == "its stream ended"
    with pytest.raises(RequestError, match=r"sequence 4 has ended \(its stream ended\)"):
        sequences.piece("4", False, False, text("more"), "d", None)


def test_a_sequence_cancelled_before_its_first_word_settled_is_forgotten_at_once(served):
    """No stream to end yet (its first word has not settled): the next sweep asks the first piece's
    sink, and a cancelled client's sequence closes then, not after the idle time, with no error
    sent to it; its id may start again."""
    _, _, sequences = served
    sink = CollectingSink()
    sequences.piece("5", True, False, {**text("Hel"), **FIRST}, "a", lambda: sink)
    sequences.expire()
    assert not sequences.open["5"].submitted
    sink.cancel = True
    sequences.expire()
    assert "5" not in sequences.open and sequences.ended["5"] == "its stream ended"
    assert not sink.done.is_set() and sink.errors == []
    again = CollectingSink()
    sequences.piece("5", True, True, {**text("Hello again."), **FIRST}, "b", lambda: again)
    assert again.done.wait(120) and not again.errors


def test_shutdown_ends_every_open_sequence_with_an_error(served):
    """Submitted or not (no word settled yet), every open sequence hears that the server stops."""
    _, service, sequences = served
    sinks = {name: CollectingSink() for name in ("spaces", "one word", "words")}
    for sequence_id, (name, first_text) in enumerate(
        (("spaces", "   "), ("one word", "Hello"), ("words", "Hello there, friend "))
    ):
        sequences.piece(
            str(sequence_id), True, False, {**text(first_text), **FIRST}, name, lambda: sinks[name]
        )
    sequences.shutdown()
    for name, sink in sinks.items():
        assert sink.done.wait(10) and sink.errors == ["server shutting down"], name
    assert not sequences.open


@pytest.mark.parametrize("policy", ["voxserve", "concurrent", "serial"])
def test_a_stream_waiting_for_text_sends_the_frames_it_has_under_every_policy(tiny_checkpoint, policy):
    """The first piece gives 6 frames (see the server test of the same name), then no text comes:
    all 6 are sent (4, the start's size, then 2) while the stream waits, also under `serial`, whose
    engine thread decodes them itself although no frame step runs; the audio is still that of one
    whole decode."""
    with text_sequences(tiny_checkpoint, policy, 60) as (_, _, sequences, codec):
        sink = CollectingSink()
        first = {"max_frames": np.array([12]), "ignore_eos": np.array([True]), "seed": np.array([2])}
        sequences.piece(
            "w", True, False, {**text("One two three four five six seven eight"), **first}, "w0", lambda: sink
        )
        wait_for(lambda: sum(int(info[2]) for info in sink.info) >= 6)
        time.sleep(0.3)  # and no more
        assert [int(info[2]) for info in sink.info] == [4, 2] and not sink.done.is_set()
        sequences.piece("w", False, True, text(" nine."), "w1", None)
        assert sink.done.wait(120) and not sink.errors
    assert_audio_is_the_whole_decode(codec, sink, 12)
