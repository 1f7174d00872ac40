"""Input streaming through a real tritonserver (tiny random-weight checkpoint): text pieces of one
Triton sequence on one gRPC stream, audio back on the first piece's request."""

from __future__ import annotations

import asyncio
import io
import json
import queue
import subprocess
import sys
import threading
import time
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile
import tritonclient.grpc as grpcclient
from server_helpers import start_server, wait_for_metric
from voxtriton_client import AsyncTTSClient, TTSClient
from voxtriton_client.api import request_inputs

from voxtriton.bench.workload import TEXTS
from voxtriton.models.text import TextTokenizer

pytestmark = pytest.mark.server

TEXT = "Text that streams in, a few words at a time, is spoken before it ends."
OPTIONS = {"seed": 11, "max_frames": 30, "ignore_eos": True}
IDLE_S = 1.5
TEXT_END_COUNT = "voxtriton_text_end_to_audio_end_seconds_count"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    parameters = {
        "tts": {
            "text_layout": "interleaved",
            "text_idle_timeout_s": str(IDLE_S),
            "max_streams": "2",
            "max_text_bytes": "256",
        }
    }
    with start_server(tiny_checkpoint, parameters=parameters) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return TTSClient(server.grpc_url)


def words(text=TEXT):
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


def slowly(pieces, pause_s):
    for piece in pieces:
        yield piece
        time.sleep(pause_s)


@pytest.mark.parametrize(
    "pieces",
    [
        lambda: [TEXT],
        lambda: words(),
        lambda: slowly(words(), 0.15),  # slower than the tiny model speaks: the stream pauses
        lambda: slowly([TEXT[i : i + 3] for i in range(0, len(TEXT), 3)], 0.02),
    ],
    ids=["one-piece", "words", "slow-words", "characters"],
)
def test_pieces_give_the_codes_of_the_whole_text(client, pieces):
    whole = client.synthesize(TEXT, codes=True, **OPTIONS).raise_for_error()
    streamed = client.synthesize_text_stream(pieces(), codes=True, **OPTIONS).raise_for_error()
    assert streamed.completed and streamed.codes.shape == (30, 16)
    np.testing.assert_array_equal(streamed.codes, whole.codes)
    assert streamed.first_audio_after_first_piece_s > 0
    assert streamed.last_audio_after_last_piece_s is not None


def test_the_server_times_the_last_piece_to_the_last_audio(server, client):
    """And every input stream's first audio after its text, also one whose text all came at once."""
    waited = "voxtriton_text_to_first_audio_seconds_count"
    before, waited_before = (server.metrics().get(name, 0) for name in (TEXT_END_COUNT, waited))
    client.synthesize_text_stream(words(), **OPTIONS).raise_for_error()
    wait_for_metric(server, TEXT_END_COUNT, lambda n: n == before + 1)
    raw = RawStream(server.grpc_url)  # a sequence of one piece, start and end at once
    try:
        raw.piece(
            uuid.uuid4().hex, "Whole at once.", "w", start=True, end=True, max_frames=8, ignore_eos=True
        )
        wait_for_metric(server, TEXT_END_COUNT, lambda n: n == before + 2)
        wait_for_metric(server, waited, lambda n: n == waited_before + 2)
    finally:
        raw.close()


def test_the_server_times_the_first_audio_from_the_text_it_waited_for(server, client):
    """Words 0.15 s apart: the first chunk waits for the words of its frames (each piece's last word
    waits for the next piece), several pieces after the first. TTFA counts from the first piece;
    the text-to-first-audio wait only from the latest words the engine had taken, so it is shorter
    by at least a piece's interval."""
    names = ("voxtriton_ttfa_seconds", "voxtriton_text_to_first_audio_seconds")
    before = {
        name: (server.metrics().get(f"{name}_count", 0), server.metrics().get(f"{name}_sum", 0))
        for name in names
    }
    client.synthesize_text_stream(slowly(words(), 0.15), **OPTIONS).raise_for_error()
    wait_for_metric(server, names[1] + "_count", lambda n: n == before[names[1]][0] + 1)
    metrics = server.metrics()
    ttfa, waited = (metrics[f"{name}_sum"] - before[name][1] for name in names)
    assert 0 < waited and ttfa - waited >= 0.15, (ttfa, waited)


def test_an_input_stream_starts_with_a_first_chunk_of_text_start_frames(client):
    """While its text is still arriving, a stream's first chunk holds `scheduler_text_start_frames`
    frames (4), its listener's buffer against the gaps between words; a whole text starts with the
    schedule's first size (2). The audio is the same, up to the rounding of other chunk bounds."""
    whole = client.synthesize(TEXT, **OPTIONS).raise_for_error()
    streamed = client.synthesize_text_stream(slowly(words(), 0.15), **OPTIONS).raise_for_error()
    assert [round(c.seconds / 0.08) for c in (whole.chunks[0], streamed.chunks[0])] == [2, 4]
    np.testing.assert_allclose(streamed.audio, whole.audio, atol=1e-5)


def test_a_request_sets_its_own_start_and_a_whole_text_cannot(client):
    """`start_frames` in the first piece: 1 starts with the schedule's first size (2), 5 with its first
    of at least 5 (8); the audio is the same. A whole text and a start below 1 are refused, naming it."""
    starts = {}
    for start in (1, 5):
        streamed = client.synthesize_text_stream(slowly(words(), 0.15), start_frames=start, **OPTIONS)
        starts[start] = streamed.raise_for_error()
    assert {start: round(s.chunks[0].seconds / 0.08) for start, s in starts.items()} == {1: 2, 5: 8}
    np.testing.assert_allclose(starts[1].audio, starts[5].audio, atol=1e-5)
    error = client.synthesize(TEXT, start_frames=4, **OPTIONS).error
    assert error is not None and error.startswith("start_frames: only an input stream takes it"), error
    error = client.synthesize_text_stream(words(), start_frames=0, **OPTIONS).error
    assert error is not None and "start_frames: must be at least 1, got 0" in error, error


class RawStream:
    """One gRPC stream to `tts`, every event (result or error) kept with its request id."""

    def __init__(self, url):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def piece(self, sequence_id, text, request_id, start=False, end=False, **options):
        self.client.async_stream_infer(
            "tts",
            request_inputs(grpcclient, text, **options),
            request_id=request_id,
            sequence_id=sequence_id,
            sequence_start=start,
            sequence_end=end,
            enable_empty_final_response=True,
        )

    def audio_samples(self, request_id, timeout=60.0, final=True) -> int:
        """The audio samples of `request_id`'s responses up to its final one (an error fails), or
        with `final` False, of those that have come so far."""
        samples, deadline = 0, time.monotonic() + timeout
        while True:
            try:
                result, error = self.events.get(
                    block=final, timeout=max(0.01, deadline - time.monotonic()) if final else None
                )
            except queue.Empty:
                return samples
            if error is not None:
                raise AssertionError(error.message())
            response = result.get_response()
            if response.id != request_id:
                continue
            if response.outputs:
                samples += len(result.as_numpy("audio"))
            if response.parameters["triton_final_response"].bool_param:
                return samples

    def next_error(self, timeout=30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            result, error = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if error is not None:
                return error.message()

    def close(self):
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def test_a_stream_waiting_for_text_sends_the_frames_it_has(server):
    """The first piece settles 7 text ids (its last word may still change): the prompt holds the
    first, the other 6 give 6 frames, then the stream waits for text. Its listener needs them, so
    it sends all 6 (a first chunk of 4, `scheduler_text_start_frames`, then 2), where the schedule
    alone would send 4 and wait for the frames of its next size, 4 (`scheduler_text_wait_send`)."""
    text_waits = "voxtriton_chunks_text_wait_total"
    before = server.metrics().get(text_waits, 0)
    raw = RawStream(server.grpc_url)
    try:
        sequence, options = uuid.uuid4().hex, {"seed": 3, "max_frames": 30, "ignore_eos": True}
        raw.piece(sequence, "One two three four five six seven eight", "t0", start=True, **options)
        sent, until = 0, time.monotonic() + 1.0  # the next piece well before the idle timeout (1.5 s)
        while sent < 6 * 1920 and time.monotonic() < until:
            time.sleep(0.05)
            sent += raw.audio_samples("t0", final=False)
        time.sleep(0.1)  # nothing more comes
        sent += raw.audio_samples("t0", final=False)
        raw.piece(sequence, " nine.", "t1", end=True)
        samples_per_frame = (sent + raw.audio_samples("t0")) / options["max_frames"]
        assert sent / samples_per_frame == 6
    finally:
        raw.close()
    wait_for_metric(server, text_waits, lambda n: n == before + 1)  # the third chunk


def test_bad_sequences_get_clear_errors_and_the_server_keeps_serving(server, client):
    raw = RawStream(server.grpc_url)
    try:
        unknown = uuid.uuid4().hex
        raw.piece(unknown, "no start", "a")
        assert f"unknown sequence {unknown!r}: its first piece must carry sequence_start" in raw.next_error()
        sequence = uuid.uuid4().hex
        raw.piece(sequence, "First piece, ", "b", start=True, **OPTIONS)
        raw.piece(sequence, "started again", "c", start=True)
        assert f"sequence {sequence!r} is already open" in raw.next_error()
        raw.piece(sequence, "and the end.", "d", end=True)
        raw.piece(sequence, " One more.", "e")
        assert f"sequence {sequence!r} has ended (its last piece arrived): a piece after its end" in (
            raw.next_error()
        )
        empty = uuid.uuid4().hex
        raw.piece(empty, " ", "f", start=True, end=True)
        assert f"sequence {empty!r}: the text is empty" in raw.next_error()
        raw.piece(uuid.uuid4().hex, "x", "g", start=True, speaker="nobody")
        assert "unknown speaker 'nobody'" in raw.next_error()
        long = uuid.uuid4().hex
        for index in range(3):  # 300 bytes in all, over max_text_bytes (256): the piece and the audio fail
            first = {"max_frames": 200} if index == 0 else {}
            raw.piece(long, "word " * 20, f"h{index}", start=index == 0, **first)
        errors = [raw.next_error(), raw.next_error()]
        assert errors == [f"text: sequence {long!r}: too long: over 256 bytes in all"] * 2
        number = int(uuid.uuid4().int % 2**62) + 1  # a string id is not the number it spells
        raw.piece(number, "Numbered, ", "i", start=True, **OPTIONS)
        raw.piece(str(number), "the end.", "j", end=True)
        assert f"unknown sequence '{number}': its first piece must carry sequence_start" in raw.next_error()
        raw.piece(number, "the end.", "k", end=True, max_frames=7)  # a later piece takes no options
        assert (
            f"max_frames: sequence {number}: only a sequence's first piece takes options" in raw.next_error()
        )
    finally:
        raw.close()
    assert client.synthesize("Still serving.", max_frames=6, ignore_eos=True).raise_for_error().completed
    assert client.synthesize_text_stream(words(), **OPTIONS).raise_for_error().completed


def test_a_stream_whose_text_stops_ends_after_the_idle_time(server, client):
    # seeded, and no end of speech: unseeded, the random weights could end the utterance before the
    # text stops, and the stream would complete instead of timing out
    synthesis = client.synthesize_text_stream(
        slowly(["Hello there, this stream goes ", "silent"], IDLE_S * 3), **OPTIONS
    )
    assert synthesis.error is not None and "text_idle_timeout_s" in synthesis.error
    # Empty pieces do not keep a sequence whose text stopped open.
    raw = RawStream(server.grpc_url)
    try:
        sequence = uuid.uuid4().hex
        raw.piece(sequence, "Kept alive by ", "k0", start=True, **OPTIONS)
        for index in range(1, 8):
            time.sleep(IDLE_S / 2)
            raw.piece(sequence, "", f"k{index}")
        assert "text_idle_timeout_s" in raw.next_error(timeout=0.1 + IDLE_S)
    finally:
        raw.close()
    # Its row is free again: both rows serve (max_streams 2).
    results = [client.synthesize_text_stream(words(), **OPTIONS) for _ in range(2)]
    assert all(r.raise_for_error().completed for r in results)


def test_the_gateway_websocket_takes_text_pieces_and_returns_pcm(server, client):
    """The gateway's WebSocket endpoint: a gateway process (uvicorn) in front of the real tritonserver,
    driven by the `websockets` client library."""
    from test_gateway import start_gateway, stop_gateway
    from websockets.sync.client import connect

    from voxtriton.serving.audio_formats import pcm16

    def speak(url: str, messages: list[dict]) -> tuple[bytes, dict]:
        """Send every message, then read binary audio until the text message that ends the stream."""
        with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as socket:
            for message in messages:
                socket.send(json.dumps(message))
            audio = b""
            while isinstance(message := socket.recv(timeout=60), bytes):
                audio += message
            return audio, json.loads(message)

    whole = client.synthesize(TEXT, speaker="vivian", **OPTIONS).raise_for_error()
    options = {"voice": "vivian", "seed": 11, "max_frames": 30, "ignore_eos": True}
    gateway, url = start_gateway(server.grpc_url)
    try:
        pieces = words()
        first, *middle, last = pieces
        audio, done = speak(
            url,
            [{"input": first, **options}] + [{"input": p} for p in middle] + [{"input": last, "end": True}],
        )
        assert done["type"] == "speech.audio.done", done
        assert done["first_audio_after_first_piece_s"] > 0 and done["last_audio_after_last_piece_s"] > 0
        # The whole text's codes, so its audio (up to rounding, were codec batches shared).
        got, expected = np.frombuffer(audio, "<i2"), np.frombuffer(pcm16(whole.audio), "<i2")
        assert got.shape == expected.shape and len(got) > 0
        assert np.abs(got.astype(np.int32) - expected).max() <= 1

        # As Ogg Opus: a binary message per chunk and one closing page, the same audio, compressed.
        opus, done = speak(
            url,
            [{"input": first, **options, "response_format": "opus"}]
            + [{"input": p} for p in middle]
            + [{"input": last, "end": True}],
        )
        assert done["type"] == "speech.audio.done" and opus[:4] == b"OggS" and len(opus) < len(audio) / 4
        with soundfile.SoundFile(io.BytesIO(opus)) as decoded:
            assert (decoded.samplerate, decoded.frames) == (24000, len(expected))
            assert np.corrcoef(decoded.read(dtype="float32"), expected / 32767.0)[0, 1] > 0.5
        _, error = speak(url, [{"input": "Hello", "response_format": "flac"}])
        assert (
            error["error"]["param"] == "response_format"
            and "'flac' is not supported" in error["error"]["message"]
        )

        _, error = speak(url, [{"input": "Hello", "voice": "nobody"}, {"input": " there.", "end": True}])
        assert error["type"] == "error" and error["error"]["param"] == "voice", error
        assert "unknown speaker 'nobody'" in error["error"]["message"]

        # start_frames goes to the server (which refuses 0), and must be an integer.
        for start, message in ((0, "must be at least 1, got 0"), ("4", "must be an integer")):
            messages = [{"input": "Hello", "start_frames": start}, {"input": " there.", "end": True}]
            _, error = speak(url, messages)
            assert error["error"]["param"] == "start_frames" and message in error["error"]["message"], error

        _, error = speak(url, [{"input": "Hello", "speed": 2}])
        assert error["error"]["param"] == "speed"
        assert "unknown field in the first message" in error["error"]["message"]

        _, error = speak(url, [{"input": "Hello there, ", **options}, {"input": "again", "voice": "ryan"}])
        assert error["error"]["param"] == "voice" and "options go in the first" in error["error"]["message"]
    finally:
        stop_gateway(gateway)


@pytest.mark.parametrize("tail", [None, 3])
def test_the_serving_benchmark_streams_text_at_a_token_rate(tmp_path, tiny_checkpoint, tail):
    """--text-rate: every request's text arrives as words at 30 per second; the same playback
    accounting, plus the last piece to the last audio. With --text-tail-frames each request asks
    for its text's ids plus that many frames."""
    out = tmp_path / "bench"
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "benchmarks" / "serving_bench.py"), "--smoke", "--text-rate", "30"]
    command += [] if tail is None else ["--text-tail-frames", str(tail)]
    completed = subprocess.run(
        command + ["--checkpoint", str(tiny_checkpoint), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["text_rate"] == 30 and results["meta"]["text_tail_frames"] == tail
    [row] = results["policies"][0]["rates"]
    assert row["requests"] >= 2 and row["failed"] == 0 and row["completed"] == row["requests"]
    assert 0 < row["ttfa_p50_ms"] < 5000 and row["text_end_to_audio_end_p50_ms"] > 0
    assert 0 < row["server"]["text_to_first_audio_ms_mean"] <= row["server"]["server_ttfa_ms_mean"]
    assert row["audio_s"] == pytest.approx(row["audio_asked_s"], rel=1e-9)
    assert sum(window["stalled"] for window in row["timeline"]) == row["stalled_requests"]
    if tail is not None:
        ids = [len(TextTokenizer(tiny_checkpoint).encode(text)) for text in TEXTS]
        frames = round(row["audio_asked_s"] * 12.5)
        assert row["requests"] * (min(ids) + tail) <= frames <= row["requests"] * (max(ids) + tail)
        assert "each length is its text's ids plus 3 frames" in (out / "results.md").read_text()


def test_the_client_command_speaks_stdin_as_it_comes(server, tmp_path):
    output = tmp_path / "lines.wav"
    command = [sys.executable, "-m", "voxtriton_client.cli", "speak", "-", "-o", str(output)]
    completed = subprocess.run(
        command + ["--server", server.grpc_url, "--max-frames", "12", "--ignore-eos", "--seed", "3"],
        input="Hello there,\nthis came on a second line.\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "last audio" in completed.stdout and "after the last line" in completed.stdout
    with wave.open(str(output)) as wav:
        assert wav.getnframes() == 12 * 1920
    refused = subprocess.run(
        command + ["--server", server.grpc_url, "--start-frames", "0"],
        input="Hello.\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "start_frames: must be at least 1" in refused.stderr, refused


def test_the_clients_count_from_the_first_piece_and_return_at_the_final_response(client):
    """A text source that waits 1 s before its first piece: the first audio's time counts from that
    piece, not from the call. One that blocks once it has given its words: the synthesis, done at
    max_frames, returns without waiting for it."""
    release = threading.Event()

    def late_then_stuck():
        time.sleep(1.0)
        yield from words()
        release.wait(60)

    called = time.perf_counter()
    first_seen = []
    synthesis = client.synthesize_text_stream(
        late_then_stuck(),
        on_chunk=lambda chunk: first_seen.append(time.perf_counter() - called),
        max_frames=3,
        ignore_eos=True,
    ).raise_for_error()
    returned = time.perf_counter() - called
    release.set()
    assert synthesis.completed and len(synthesis.audio) == 3 * 1920
    assert synthesis.first_audio_after_first_piece_s <= first_seen[0] - 1.0
    assert returned < 30, returned

    async def stuck_async():
        yield TEXT
        await asyncio.sleep(60)

    async def returns_at_the_final_response():
        async with AsyncTTSClient(client.url) as async_client:
            return await async_client.synthesize_text_stream(stuck_async(), max_frames=3, ignore_eos=True)

    called = time.perf_counter()
    assert asyncio.run(returns_at_the_final_response()).raise_for_error().completed
    assert time.perf_counter() - called < 30


def test_the_async_client_ends_with_its_timeout_and_the_text_sources_error(client):
    """No final response within `timeout`: an error, not a wait for ever. A text source that raises:
    its error, not a bare cancel. A blocking text source (a plain iterator) does not stall the event
    loop. The server keeps serving."""

    def llm_that_fails():
        yield "Hello there,"
        raise ValueError("the LLM failed")

    def blocking_words():  # a blocking source, as stdin: it would hold the event loop 1 s a piece
        for piece in ("Hello there,", " and then", " goodbye."):
            time.sleep(1.0)
            yield piece

    async def scenario():
        gaps = [0.0]

        async def tick():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        async with AsyncTTSClient(client.url) as async_client:
            slow = await async_client.synthesize(TEXT, max_frames=600, ignore_eos=True, timeout=0.5)
            failed = await async_client.synthesize_text_stream(llm_that_fails(), **OPTIONS)
            ticker = asyncio.create_task(tick())
            blocked = await async_client.synthesize_text_stream(blocking_words(), **OPTIONS)
            ticker.cancel()
            return slow, failed, blocked, max(gaps)

    slow, failed, blocked, longest_gap = asyncio.run(scenario())
    assert slow.error == "no final response within 0.5 s" and not slow.completed
    assert failed.error == "text pieces failed: ValueError('the LLM failed')"
    assert blocked.raise_for_error().completed and longest_gap < 0.8, longest_gap
    assert client.synthesize(TEXT, **OPTIONS).raise_for_error().completed


def test_a_synthesis_that_ends_early_leaves_no_grpc_thread_behind(client):
    """tritonclient cancels a stream's call but leaves gRPC's thread that reads its requests waiting:
    a synthesis the server refuses (an unknown voice) or that its caller stops must not leave one
    behind each time."""
    before = threading.active_count()
    for _ in range(4):
        assert client.synthesize(TEXT, speaker="no_such_voice", max_frames=3).error
        events = client.stream(TEXT, **OPTIONS)
        next(events)
        events.close()  # stopped after its first chunk: cancelled
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_a_text_piece_that_is_not_a_str_is_refused_not_spoken(client):
    """An LLM stream's empty delta is often None: tritonclient would send it as the word "None"."""
    sync = client.synthesize_text_stream(["Hello there,", None], **OPTIONS)
    assert sync.error == "text pieces failed: TypeError('text piece 1 must be a str, got NoneType')"

    async def pieces_with_a_number():
        async with AsyncTTSClient(client.url) as async_client:
            return await async_client.synthesize_text_stream(["Hello there,", 42], **OPTIONS)

    assert asyncio.run(pieces_with_a_number()).error == (
        "text pieces failed: TypeError('text piece 1 must be a str, got int')"
    )
    with pytest.raises(TypeError, match="text must be a str, got NoneType"):
        client.synthesize(None, **OPTIONS)
    assert client.synthesize(TEXT, **OPTIONS).raise_for_error().completed


def test_the_sync_clients_timeout_counts_from_a_late_first_piece(client):
    """The first piece comes 0.1 s before the timeout would end a wait counted from the call: the
    synthesis gets its whole timeout from that piece."""

    def late():
        time.sleep(3.9)
        yield TEXT

    synthesis = client.synthesize_text_stream(late(), timeout=4.0, **OPTIONS)
    assert synthesis.raise_for_error().completed


def test_asyncio_run_returns_while_a_plain_text_source_still_blocks(client):
    """A plain iterator (stdin, say) blocked after the synthesis ended at max_frames: `asyncio.run`
    returns without waiting for it."""
    release = threading.Event()

    def words_then_blocked():
        yield TEXT
        release.wait(45)

    async def run():
        async with AsyncTTSClient(client.url) as async_client:
            return await async_client.synthesize_text_stream(
                words_then_blocked(), max_frames=3, ignore_eos=True
            )

    called = time.perf_counter()
    try:
        assert asyncio.run(run()).raise_for_error().completed
        assert time.perf_counter() - called < 30
    finally:
        release.set()
