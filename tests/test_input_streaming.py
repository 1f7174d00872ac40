"""Input streaming in the engine (CPU, tiny random-weight checkpoint): text sent in pieces, whatever
their timing, gives the codes of the same text sent whole in the interleaved layout."""

from __future__ import annotations

import numpy as np
import pytest

from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextStream, TextTokenizer

TEXT = "Hello there, streaming text arrives piece by piece: does it sound the same?"
FRAMES = 40  # past the text's end (about 20 tokens), so padding after tts_eos is covered too


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    config = load_config(tiny_checkpoint)
    tokenizer = TextTokenizer(tiny_checkpoint)
    return config, load_backbone(tiny_checkpoint, config), PromptBuilder(config, tokenizer), tokenizer


@pytest.fixture(params=[False, True], ids=["in-step", "overlap"])
def overlap(request):
    return request.param


def params(setup, seed=7):
    return GenerationParams.create(setup[0].generation, 1000, seed=seed, max_frames=FRAMES, ignore_eos=True)


def new_engine(setup, overlap=False, lookahead=1):
    runner = ModelRunner(setup[1], max_rows=4, max_positions=512, max_text_tokens=64)
    return Engine(runner, max_running=4, overlap=overlap, text_lookahead=lookahead)


def whole(setup, request_id="whole", text=TEXT, seed=7):
    return Request(request_id, setup[2].build(text, "vivian", interleaved=True), params(setup, seed))


class Piecewise:
    """One streamed request: pieces of text arrive before given steps, the end after the last."""

    def __init__(self, setup, schedule: dict[int, list[str]], end_step: int, request_id="pieces"):
        self.setup, self.schedule, self.end_step, self.request_id = setup, schedule, end_step, request_id
        self.text = TextStream(setup[3])
        self.head = setup[2].head("vivian")
        self.known: list[int] = []
        self.request: Request | None = None
        self.paused_steps = 0  # steps at whose end the request waited for text

    def before_step(self, engine: Engine, step: int) -> None:
        ids = [i for piece in self.schedule.get(step, []) for i in self.text.feed(piece)]
        end = step == self.end_step
        if end:
            ids += self.text.finish()
        if self.request is None:
            self.known += ids
            if self.known:  # the prompt holds the first text id
                prompt = self.head.prompt(self.known, interleaved=True, text_ended=end)
                self.request = Request(self.request_id, prompt, params(self.setup), text_open=not end)
                engine.add(self.request)
        elif ids or end:
            engine.add_text(self.request, ids, end)

    @property
    def pending(self) -> bool:
        return self.request is None or self.request.text_open


def run(engine, streams=(), arrivals=None):
    codes: dict[str, list] = {}
    step = 0
    arrivals = arrivals or {}
    while engine.has_work or any(s.pending for s in streams) or any(s >= step for s in arrivals):
        for request in arrivals.get(step, []):
            engine.add(request)
        for stream in streams:
            stream.before_step(engine, step)
        for output in engine.step():
            codes.setdefault(output.request.request_id, []).append(output.codes)
        for stream in streams:
            stream.paused_steps += stream.request is not None and stream.request.paused
        step += 1
        assert step < 2000
    return {k: np.stack(v) for k, v in codes.items()}


def words(text=TEXT):
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


def characters(text=TEXT):
    return list(text)


SCHEDULES = {
    # all text at once, its end much later: the stream pauses on its last id until the end arrives
    "all-then-late-end": (lambda: ({0: [TEXT]}, 30)),
    # a word every step: about as fast as speech
    "word-per-step": (lambda: ({i: [w] for i, w in enumerate(words())}, len(words()))),
    # a word every fourth step: slower than speech, so it pauses often
    "slow-words": (lambda: ({4 * i: [w] for i, w in enumerate(words())}, 4 * len(words()))),
    # single characters, three per step: pieces split tokens, and the tokenizer must wait for them
    "characters": (lambda: ({i // 3: [c] for i, c in enumerate(characters())}, len(TEXT) // 3 + 1)),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_text_in_pieces_gives_the_codes_of_the_whole_text(setup, overlap, schedule):
    expected = run(new_engine(setup), arrivals={0: [whole(setup)]})
    pieces, end_step = SCHEDULES[schedule]()
    stream = Piecewise(setup, pieces, end_step)
    got = run(new_engine(setup, overlap=overlap), [stream])
    assert got["pieces"].shape == (FRAMES, 16)
    np.testing.assert_array_equal(got["pieces"], expected["whole"])
    # The equality above covers pauses where the schedule is slower than speech.
    assert (stream.paused_steps > 0) == (schedule != "word-per-step")


@pytest.mark.parametrize("lookahead", [2, 5])
def test_lookahead_changes_timing_not_codes(setup, overlap, lookahead):
    expected = run(new_engine(setup), arrivals={0: [whole(setup)]})
    pieces, end_step = SCHEDULES["slow-words"]()
    stream = Piecewise(setup, pieces, end_step)
    engine = new_engine(setup, overlap=overlap, lookahead=lookahead)
    got = run(engine, [stream])
    np.testing.assert_array_equal(got["pieces"], expected["whole"])
    assert stream.paused_steps > 0


def test_a_paused_stream_does_not_disturb_the_rows_beside_it(setup, overlap):
    """Whole-text requests in the same batch as a pausing stream get their codes alone."""

    def beside():
        return [whole(setup, f"other{i}", f"Another request, number {i}, speaks.", seed=i) for i in range(2)]

    alone = {}
    for request in beside():
        alone.update(run(new_engine(setup), arrivals={0: [request]}))
    expected = run(new_engine(setup), arrivals={0: [whole(setup)]})
    pieces, end_step = SCHEDULES["slow-words"]()
    stream = Piecewise(setup, pieces, end_step)
    others = beside()
    got = run(new_engine(setup, overlap=overlap), [stream], arrivals={0: others[:1], 9: others[1:]})
    np.testing.assert_array_equal(got["pieces"], expected["whole"])
    for request_id, codes in alone.items():
        np.testing.assert_array_equal(got[request_id], codes)


def test_a_stream_waits_for_its_lookahead_before_it_starts(setup):
    engine = new_engine(setup, lookahead=3)
    stream = Piecewise(setup, {0: ["Hello there, "]}, end_step=50)
    stream.before_step(engine, 0)
    assert stream.request is not None and len(stream.request.text) < 3
    assert engine.step() == [] and not engine.running and not engine.has_work
    engine.add_text(stream.request, stream.text.feed("more words "), end=False)
    assert engine.has_work
    engine.step()
    assert engine.running == [stream.request]


def test_text_pieces_tokenize_as_the_whole_text(setup):
    tokenizer = setup[3]
    for pieces in (
        words(),
        characters(),
        [TEXT[:7], TEXT[7:8], TEXT[8:]],
        ["Ca", "fe\u0301 ", "  x\n", "\ny"],
    ):
        stream = TextStream(tokenizer)
        ids = [i for piece in pieces for i in stream.feed(piece)] + stream.finish()
        assert ids == tokenizer.encode("".join(pieces)), pieces


def test_text_beyond_the_rows_capacity_or_after_its_end_is_refused(setup):
    engine = new_engine(setup)  # max_text_tokens 64
    request = Request("long", setup[2].head("vivian").prompt([1000], True, text_ended=False), params(setup))
    request.text_open = True
    engine.add(request)
    engine.add_text(request, [1000] * 64, end=False)
    with pytest.raises(ValueError, match=r"text: too long: 65 tokens \(limit 64\)"):
        engine.add_text(request, [1000], end=False)
    done = whole(setup)
    with pytest.raises(ValueError, match="takes no more text"):
        engine.add_text(done, [1000], end=True)


def test_a_request_waits_for_text_once_every_frame_it_generated_is_returned(setup, overlap):
    """`waiting_for_text` lists a request that cannot generate until more text comes, only once the
    frames of its text are all back: with overlap, one step after the step that launched the last."""
    engine = new_engine(setup, overlap=overlap)
    stream = Piecewise(setup, {0: ["One two three four five six seven eight"]}, end_step=100)
    returned, waiting_since = 0, None
    for step in range(12):
        stream.before_step(engine, step)
        returned += len(engine.step())
        if engine.waiting_for_text() and waiting_since is None:
            waiting_since = step
        assert engine.waiting_for_text() in ([], [stream.request])
        if engine.waiting_for_text():
            assert returned == stream.request.frames == len(stream.request.text) == 6
    # 6 frames, one a step from the step that admits the request; with overlap each comes a step later.
    assert waiting_since == (6 if overlap else 5)
    assert not engine.has_work
