"""The tts service with in-process codec lanes: every codec slot comes back, and padded last chunks
deliver exactly their own frames and audio."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from sinks import CollectingSink

from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.errors import ServerBusy
from voxtriton.models.config import load_config
from voxtriton.models.families import load_family
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.scheduler.policy import BACKGROUND, INLINE, URGENT, SchedulerConfig
from voxtriton.serving.codec_service import CodecService, InProcessLane
from voxtriton.serving.requests import RequestParser
from voxtriton.serving.service import cancellation
from voxtriton.serving.settings import CodecSettings, TTSSettings
from voxtriton.serving.state_pool import CodecStatePool
from voxtriton.serving.tts_service import MAX_HOLD_S, TTSService, codec_slots
from voxtriton.serving.voices import VoiceEncoder


class LaneThatFailsAfterCancellation:
    """A codec lane whose first call waits until the test has cancelled the stream, then fails."""

    def __init__(self):
        self.called, self.release = threading.Event(), threading.Event()

    def decode(self, codes, start, slots, prime=False):
        self.called.set()
        self.release.wait(60)
        raise RuntimeError("codec process died")


class CancellableSink:
    def __init__(self):
        self.cancel, self.errors, self.chunks = False, [], 0

    def send(self, audio, codes, info, final):
        self.chunks += 1

    def fail(self, message):
        self.errors.append(message)

    def cancelled(self):
        return self.cancel


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def fixed_length(text: bytes, frames: int, **fields) -> dict:
    """A request's inputs for `frames` frames of `text`, whatever the random weights sample."""
    inputs = {
        "text": np.array([text], dtype=object),
        "max_frames": np.array([frames]),
        "ignore_eos": np.array([True]),
    }
    return inputs | {name: np.array([value]) for name, value in fields.items()}


def engine_and_parser(
    tiny_checkpoint, policy: str, first_frame_rows: int = 0, **scheduler
) -> tuple[Engine, RequestParser, SchedulerConfig]:
    """The tiny backbone's engine with two rows, built as the tts model builds it (overlapped, except
    under serial; first frames early up to `first_frame_rows` rows), a request parser and the
    scheduler's configuration."""
    config = load_config(tiny_checkpoint)
    settings = TTSSettings(checkpoint_dir=str(tiny_checkpoint), max_streams=2, max_positions=256)
    runner = ModelRunner(load_backbone(tiny_checkpoint, config), 2, 256, settings.max_text_tokens)
    parser = RequestParser(config, PromptBuilder(config, TextTokenizer(tiny_checkpoint)), settings)
    engine = Engine(runner, 2, overlap=policy != "serial", first_frame_rows=first_frame_rows)
    return engine, parser, SchedulerConfig(policy=policy, **scheduler)


def cpu_codec(
    tiny_checkpoint, engine: Engine, scheduler_config: SchedulerConfig, lane_workers: int = 1
) -> tuple[CodecService, CodecStatePool]:
    """A CPU codec and a state pool with the rows the service needs (max_queued=1)."""
    codec = CodecService(CodecSettings(checkpoint_dir=str(tiny_checkpoint), device="cpu"))
    return codec, CodecStatePool(
        codec_slots(engine, 1, scheduler_config, lane_workers), codec.state_size, "cpu"
    )


@pytest.mark.parametrize("policy", ["concurrent", "serial"])
def test_a_slot_comes_back_when_a_lane_fails_a_stream_that_was_cancelled_meanwhile(tiny_checkpoint, policy):
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, policy)
    lane = LaneThatFailsAfterCancellation()
    service = TTSService(
        engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1, cancellation_check_s=0.01
    )
    try:
        slots = codec_slots(engine, 1, scheduler_config)
        sink = CancellableSink()
        inputs = fixed_length(b"Cancelled while decoding.", 40)
        service.submit(parser.parse("r1", inputs), sink)
        assert lane.called.wait(60)  # (under serial it is the engine thread that waits in the call)
        sink.cancel = True
        wait_for(lambda: "r1" not in service.streams)  # ended by the cancellation watcher
        assert len(service.free_slots) == slots - 1  # the lane may still write its row
        lane.release.set()
        wait_for(lambda: len(service.free_slots) == slots)
        assert sink.chunks == 0 and sink.errors == ["request cancelled"]  # the lane's failure comes after
        assert service.draining == 0
    finally:
        lane.release.set()
        service.shutdown()


def test_the_watcher_lets_the_lock_go_after_max_hold_s_and_its_sweep_still_reaches_every_stream(
    tiny_checkpoint,
):
    """Checks of a millisecond, no shorter than MAX_HOLD_S: every hold of the lock is one check, and
    a cancelled stream at the end of the list, many holds into a sweep, is still ended, with the
    error, and only that one."""
    assert MAX_HOLD_S <= 0.001
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    lane = LaneThatFailsAfterCancellation()  # holds the first chunk: nothing finishes meanwhile
    checks = []
    metrics = HoldRecorder(checks)
    count = 12
    service = TTSService(
        engine,
        scheduler_config,
        {URGENT: lane, BACKGROUND: lane},
        max_queued=count,
        cancellation_check_s=0.01,
        metrics=metrics,
    )
    try:
        inputs = fixed_length(b"Queued.", 40)
        sinks = [SlowCheckSink(f"r{index}", checks) for index in range(count)]
        for index, sink in enumerate(sinks):
            service.submit(parser.parse(f"r{index}", inputs), sink)
        last = f"r{count - 1}"
        sinks[-1].cancel = True
        wait_for(lambda: last not in service.streams)
        assert sinks[-1].errors == ["request cancelled"]
        assert len(service.streams) == count - 1 and not any(sink.errors for sink in sinks[:-1])
        assert len(metrics.holds) >= count - 1 and {streams for streams, *_ in metrics.holds} == {1}
    finally:
        lane.release.set()
        service.shutdown()


class SlowCheckSink(CancellableSink):
    """A sink whose cancellation check takes a millisecond (a slow round trip to the server process)
    and names its stream in `checks`."""

    def __init__(self, name, checks):
        super().__init__()
        self.name, self.checks = name, checks

    def cancelled(self):
        time.sleep(0.001)
        self.checks.append(self.name)
        return self.cancel


class DroppedMetrics:
    """Service metrics that drop every update; the recorders below keep the ones their tests read."""

    def chunk_sent(self, *args, **kwargs): ...
    def codec_call(self, *args): ...
    def rejected(self): ...
    def cancellation_checks(self, *args): ...
    def frame_step(self, *args): ...
    def first_chunk_hold(self, *args): ...
    def gauges(self, *args): ...


class HoldRecorder(DroppedMetrics):
    """Service metrics that keep the cancellation watcher's holds of the lock: (streams checked,
    seconds held, when it reported, checks made by then)."""

    def __init__(self, checks):
        self.checks, self.holds = checks, []

    def cancellation_checks(self, streams, seconds):
        self.holds.append((streams, seconds, time.perf_counter(), len(self.checks)))


def test_the_cancellation_watcher_paces_its_holds_and_checks_draining_streams_last(
    tiny_checkpoint, monkeypatch
):
    """With cancellation_lock_share 0.25, the watcher lets the lock go for at least three times each
    hold before the next (so it holds it at most a quarter of the time), and a sweep checks the
    streams still generating or queued before those that have generated all their frames. Holds
    of up to a second make each sweep one hold, so the holds tell the sweeps apart."""
    monkeypatch.setattr(cancellation, "MAX_HOLD_S", 1.0)
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    lane = LaneThatFailsAfterCancellation()  # holds the first chunk: no stream ends meanwhile
    checks = []
    metrics = HoldRecorder(checks)
    names = [f"r{index}" for index in range(21)]
    service = TTSService(
        engine,
        scheduler_config,
        {URGENT: lane, BACKGROUND: lane},
        max_queued=len(names),
        cancellation_check_s=0.01,
        metrics=metrics,
        cancellation_lock_share=0.25,
    )
    try:
        inputs = fixed_length(b"Queued.", 40)
        for name in names:
            service.submit(parser.parse(name, inputs), SlowCheckSink(name, checks))
        wait_for(lambda: service.draining >= 2)  # the first two have generated theirs (two rows)
        seen = len(metrics.holds)
        wait_for(lambda: len(metrics.holds) >= seen + 3)  # two whole sweeps after that
        holds = metrics.holds[seen:]
        assert [streams for streams, *_ in holds] == [len(names)] * len(holds)
        for (_, held, reported, _), (_, next_held, next_reported, _) in zip(holds, holds[1:]):
            next_started = next_reported - next_held
            assert (
                next_started - reported >= 0.9 * 3 * held
            )  # (0.9: the report comes a little after the hold)
        sweep = checks[holds[1][3] - len(names) : holds[1][3]]
        assert sorted(sweep) == sorted(names)  # every stream once
        generated = len(sweep) - sweep.index("r0")  # the streams checked from r0 on
        assert 2 <= generated < len(names)
        assert sweep == names[generated:] + names[:generated]  # the generated ones (the first admitted) last
    finally:
        lane.release.set()
        service.shutdown()


def speak(service: TTSService, request) -> CollectingSink:
    """Submit one request, wait for its stream to end without an error, and shut the service down."""
    try:
        sink = CollectingSink()
        service.submit(request, sink)
        assert sink.done.wait(120) and sink.errors == []
        return sink
    finally:
        service.shutdown()


def assert_audio_is_the_whole_decode(codec: CodecService, sink: CollectingSink, frames: int) -> None:
    """The stream got `frames` frames of codes and, chunk by chunk, exactly the audio of decoding them
    in one piece."""
    codes = np.concatenate(sink.codes)
    assert codes.shape == (frames, 16)
    whole, _ = codec.model.decode(
        torch.from_numpy(codes)[None].long(), torch.zeros(1, dtype=torch.long), codec.model.new_state(1)
    )
    assert np.abs(np.concatenate(sink.audio) - whole[0].float().numpy()).max() <= 1e-4


@pytest.mark.parametrize("policy", ["concurrent", "serial"])
def test_a_short_last_chunk_is_decoded_padded_and_delivered_exact(tiny_checkpoint, policy):
    """13 frames under the schedule 2,2,4,4,8: the last chunk holds 1 frame, decoded padded to 8.
    The stream still gets 13 frames of codes and exactly the audio of decoding them in one piece."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, policy, chunk_schedule="2,2,4,4,8")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    trace = io.StringIO()
    service = TTSService(
        engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1, chunk_trace=trace
    )
    sink = speak(service, parser.parse("r1", fixed_length(b"Padded at the end.", 13, seed=5)))
    assert [int(info[2]) for info in sink.info] == [2, 2, 4, 4, 1]
    assert [len(audio) for audio in sink.audio] == [1920 * int(info[2]) for info in sink.info]
    assert_audio_is_the_whole_decode(codec, sink, 13)
    # The chunk trace: one line per chunk, in order, each chunk cut only after the previous one was
    # sent, due at the TTFA target (first chunk) or when the audio sent before it has played.
    lines = [json.loads(line) for line in trace.getvalue().splitlines()]
    records = [r for r in lines if r["kind"] == "chunk"]
    # And one line per frame step that returned frames: 13 frames in all, one admission, times that add up.
    steps = [r for r in lines if r["kind"] == "step"]
    assert sum(r["frames"] for r in steps) == 13 and sum(r["admitted"] for r in steps) == 1
    assert all(r["period"] >= r["admit_s"] + r["decode_s"] for r in steps)
    # The engine thread's CPU time outside the decode is at most that part's wall time (1 ms for the
    # clocks being read apart).
    assert all(0 <= r["host_cpu_s"] <= r["period"] - r["decode_s"] + 1e-3 for r in steps)
    assert [(r["index"], r["frames"], r["batch"]) for r in records] == [
        (i, n, 1) for i, n in enumerate([2, 2, 4, 4, 1])
    ]
    assert {r["lane"] for r in records} == {"inline" if policy == "serial" else "urgent"}
    for previous, record in zip([None] + records, records):
        assert record["arrived"] <= record["cut"] <= record["start"] <= record["end"] <= record["sent"]
        assert previous is None or record["cut"] >= previous["sent"]
    assert records[0]["due"] == pytest.approx(records[0]["arrived"] + scheduler_config.ttfa_target_s)
    # Playback starts when the first chunk is sent; a stall (a slow CI host) only moves later deadlines later.
    assert records[1]["due"] >= records[0]["sent"] + 2 * 0.08 - 1e-3
    for previous, record in zip(records[1:], records[2:]):
        assert record["due"] >= previous["due"] + previous["frames"] * 0.08 - 1e-6


@pytest.mark.parametrize("policy", ["concurrent", "serial"])
def test_a_first_frame_returned_early_starts_a_one_frame_chunk_and_the_audio_stays_exact(
    tiny_checkpoint, policy
):
    """The engine returns first frames before its step ends (`first_frame_rows`; with overlap, not
    under serial) and the scheduler starts light streams with one frame: the stream gets 1, 2, 2, 4
    frames and exactly the audio of its whole decode."""
    engine, parser, scheduler_config = engine_and_parser(
        tiny_checkpoint, policy, 2, chunk_schedule="2,2,4,4,8", single_frame_start_streams=2
    )
    early, first_frames = [], engine._first_frames

    def recorded(launched):
        outputs = first_frames(launched)
        early.extend(outputs)
        return outputs

    engine._first_frames = recorded
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    sink = speak(service, parser.parse("r1", fixed_length(b"Early.", 9, seed=3)))
    assert [int(info[2]) for info in sink.info] == [1, 2, 2, 4]
    assert_audio_is_the_whole_decode(codec, sink, 9)
    assert [output.request.request_id for output in early] == (["r1"] if policy == "concurrent" else [])


class LaneWithASlowFirstCall:
    """Its first call takes `delay` seconds longer, or ends its wait once `until()` is true (`met`); it
    notes how many frames its stream generated during that call (`frames_generated()` before and
    after), and what `observe()` says as it starts (`observed`)."""

    def __init__(self, lane, frames_generated, delay=0.3, until=lambda: False, observe=lambda: None):
        self.lane, self.frames_generated, self.delay, self.until = lane, frames_generated, delay, until
        self.observe, self.observed = observe, None
        self.calls, self.frames_during_first, self.met = 0, None, False
        self.first_started = threading.Event()

    def decode(self, codes, start, slots, prime=False):
        self.calls += 1
        if self.calls > 1:
            return self.lane.decode(codes, start, slots, prime)
        before, self.observed = self.frames_generated(), self.observe()
        self.first_started.set()
        waited_until = time.monotonic() + self.delay
        while not self.until() and time.monotonic() < waited_until:
            time.sleep(0.005)
        self.met = self.until()
        audio = self.lane.decode(codes, start, slots, prime)
        self.frames_during_first = self.frames_generated() - before
        return audio


class FirstChunkHoldRecorder(DroppedMetrics):
    """Service metrics that keep the engine's holds for first chunks (seconds each)."""

    def __init__(self):
        self.holds = []

    def first_chunk_hold(self, seconds):
        self.holds.append(seconds)


@pytest.mark.parametrize("hold_s, first_frame_rows", [(0.0, 0), (30.0, 0), (0.0, 2), (30.0, 2)])
def test_the_engine_holds_its_frame_steps_while_a_first_chunk_decodes(
    tiny_checkpoint, hold_s, first_frame_rows
):
    """`first_chunk_hold_s`: under light load, no frame comes out of the engine while a stream's first
    chunk is in its codec call (a slow one here), the lane that returns it wakes the engine (long
    before the 30 s limit), and the audio is the same; without it, the backbone goes on generating
    meanwhile. With first frames early, the backbone's part of the first frame's step waits for the
    call too (`defer_advance`), and only where the hold applies."""
    engine, parser, scheduler_config = engine_and_parser(
        tiny_checkpoint, "concurrent", first_frame_rows, chunk_schedule="2,4", single_frame_start_streams=1,
        first_chunk_hold_s=hold_s,
    )  # fmt: skip
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = LaneWithASlowFirstCall(  # (`service` is read once the lane is called)
        InProcessLane(codec, pool.tensor),
        lambda: service.scheduler.streams["r1"].frames_generated,
        observe=lambda: engine.deferred is not None,
    )
    metrics = FirstChunkHoldRecorder()
    service = TTSService(engine, scheduler_config, {URGENT: lane}, max_queued=1, metrics=metrics)
    sink = speak(service, parser.parse("r1", fixed_length(b"Hold on.", 20, seed=3)))
    assert [int(info[2]) for info in sink.info] == [1, 2, 4, 4, 4, 4, 1]
    assert (lane.frames_during_first == 0) is (hold_s > 0), lane.frames_during_first
    assert lane.observed is (hold_s > 0 and first_frame_rows > 0)
    assert (len(metrics.holds) > 0) is (hold_s > 0) and sum(metrics.holds) < 10
    assert_audio_is_the_whole_decode(codec, sink, 20)


def test_a_request_that_arrives_ends_the_hold_for_a_first_chunk(tiny_checkpoint):
    """`first_chunk_hold_s`: a request that arrives while the engine holds for another stream's first
    chunk is admitted at once, and the backbone runs for its first frames during that chunk's codec
    call (which here lasts until the newcomer has a frame, at most 30 s); both streams get their
    whole audio."""
    engine, parser, scheduler_config = engine_and_parser(
        tiny_checkpoint, "concurrent", chunk_schedule="2,4", single_frame_start_streams=2,
        first_chunk_hold_s=30.0,
    )  # fmt: skip
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)

    def frames(request_id):  # (`service` is read once the lane is called)
        stream = service.scheduler.streams.get(request_id)
        return 0 if stream is None else stream.frames_generated

    lane = LaneWithASlowFirstCall(
        InProcessLane(codec, pool.tensor), lambda: frames("r1"), delay=30, until=lambda: frames("r2") > 0
    )
    metrics = FirstChunkHoldRecorder()
    service = TTSService(engine, scheduler_config, {URGENT: lane}, max_queued=1, metrics=metrics)
    try:
        sinks = [CollectingSink(), CollectingSink()]
        inputs = fixed_length(b"Make way.", 8, seed=3)
        service.submit(parser.parse("r1", inputs), sinks[0])
        assert lane.first_started.wait(60)  # r1's first chunk is in its codec call, the engine held
        service.submit(parser.parse("r2", inputs), sinks[1])
        assert all(sink.done.wait(120) and sink.errors == [] for sink in sinks)
    finally:
        service.shutdown()
    assert lane.met, "the newcomer got no frame while the first chunk's call was out"
    assert len(metrics.holds) > 0 and sum(metrics.holds) < 10  # the engine held, and gave way
    assert lane.frames_during_first > 0  # r1 went on in the newcomer's steps
    for sink in sinks:
        assert_audio_is_the_whole_decode(codec, sink, 8)


class LaneThatHoldsItsFirstCallUntilASecondStarts:
    """Its first call waits until a second call starts, or 30 s pass; calls then decode one at a time,
    as Triton runs them at one codec instance."""

    def __init__(self, lane):
        self.lane, self.calls = lane, 0
        self.lock, self.decoding = threading.Lock(), threading.Lock()
        self.first_started, self.second_started = threading.Event(), threading.Event()
        self.released = False  # the first call was released by a second, not timed out

    def decode(self, codes, start, slots, prime=False):
        with self.lock:
            self.calls += 1
            call = self.calls
        if call == 1:
            self.first_started.set()
            self.released = self.second_started.wait(30)
        elif call == 2:
            self.second_started.set()
        with self.decoding:
            return self.lane.decode(codes, start, slots, prime)


def test_a_stream_still_sending_audio_counts_against_light_load_for_early_first_frames(tiny_checkpoint):
    """One stream alone starts with one frame, returned early. A second that starts while the first
    has left the engine but still sends its audio is not under light load (two streams open against
    `single_frame_start_streams` 1): it starts with the schedule's 2 frames and its first frame is not
    returned early either (the engine, running one row, would have split that step for nothing)."""
    engine, parser, scheduler_config = engine_and_parser(
        tiny_checkpoint, "concurrent", 1, chunk_schedule="2,2,4", single_frame_start_streams=1
    )
    early, first_frames = [], engine._first_frames

    def recorded(launched):
        outputs = first_frames(launched)
        early.extend(output.request.request_id for output in outputs)
        return outputs

    engine._first_frames = recorded
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config, lane_workers=2)
    lane = LaneThatHoldsItsFirstCallUntilASecondStarts(InProcessLane(codec, pool.tensor))
    service = TTSService(
        engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1, lane_workers=2
    )
    try:
        sinks = [CollectingSink(), CollectingSink()]
        service.submit(parser.parse("r1", fixed_length(b"Still sending.", 5, seed=3)), sinks[0])
        assert lane.first_started.wait(60)  # r1's first chunk is held: r1 stays open
        wait_for(lambda: not engine.running and not engine.waiting)  # r1 has generated all 5 frames
        service.submit(parser.parse("r2", fixed_length(b"Not light.", 6, seed=4)), sinks[1])
        assert all(sink.done.wait(120) and sink.errors == [] for sink in sinks)
        assert lane.released
    finally:
        service.shutdown()
    assert early == ["r1"]
    assert [int(info[2]) for info in sinks[0].info][0] == 1
    assert [int(info[2]) for info in sinks[1].info] == [2, 2, 2]
    assert_audio_is_the_whole_decode(codec, sinks[1], 6)


def test_two_lane_workers_keep_two_codec_calls_in_flight_and_the_audio_exact(tiny_checkpoint):
    """A second stream's chunk is decoded while the lane's first call is still out, and both streams
    get exactly the audio of decoding their codes in one piece; every codec slot comes back."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2,4")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config, lane_workers=2)
    lane = LaneThatHoldsItsFirstCallUntilASecondStarts(InProcessLane(codec, pool.tensor))
    trace = io.StringIO()
    service = TTSService(
        engine,
        scheduler_config,
        {URGENT: lane, BACKGROUND: lane},
        max_queued=1,
        lane_workers=2,
        chunk_trace=trace,
    )
    try:
        sinks = [CollectingSink(), CollectingSink()]
        inputs = fixed_length(b"Two calls at once.", 10, seed=3)
        service.submit(parser.parse("r1", inputs), sinks[0])
        assert lane.first_started.wait(60)  # the first stream's first chunk is out
        service.submit(parser.parse("r2", inputs), sinks[1])
        assert all(sink.done.wait(120) and sink.errors == [] for sink in sinks)
        assert lane.released, "the second call never started while the first was out"
        wait_for(lambda: len(service.free_slots) == codec_slots(engine, 1, scheduler_config, 2))
    finally:
        service.shutdown()
    # A call that waited for the lane's other call counts from that call's end, so the lane's calls,
    # as the scheduler's decode estimate and the trace see them, never overlap.
    calls = sorted(
        {
            (r["start"], r["end"])
            for r in map(json.loads, trace.getvalue().splitlines())
            if r["kind"] == "chunk"
        },
        key=lambda call: call[1],
    )
    assert len(calls) >= 2 and all(later[0] >= earlier[1] for earlier, later in zip(calls, calls[1:]))
    for sink in sinks:
        assert_audio_is_the_whole_decode(codec, sink, 10)


class SinkThatTriesTheServiceLock(CollectingSink):
    """Records, for each chunk, whether another thread could take the service lock during the send."""

    def __init__(self):
        super().__init__()
        self.service, self.lock_free = None, []

    def send(self, audio, codes, info, final):
        def try_lock():
            if self.service.lock.acquire(timeout=5):
                self.service.lock.release()
                self.lock_free.append(True)
            else:
                self.lock_free.append(False)

        other = threading.Thread(target=try_lock)
        other.start()
        other.join()
        super().send(audio, codes, info, final)


def test_audio_is_sent_without_the_service_lock(tiny_checkpoint):
    """A send is an IPC round trip per chunk in the server; the engine and the other lanes must not
    wait for it."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2,4")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    try:
        sink = SinkThatTriesTheServiceLock()
        sink.service = service
        inputs = fixed_length(b"Sent freely.", 10)
        service.submit(parser.parse("r1", inputs), sink)
        assert sink.done.wait(120) and sink.errors == []
    finally:
        service.shutdown()
    assert sink.lock_free == [True] * 3  # chunks of 2, 4 and 4 frames


class SlowSink(CollectingSink):
    def send(self, audio, codes, info, final):
        time.sleep(0.2)
        super().send(audio, codes, info, final)


def test_each_chunk_counts_as_sent_when_its_own_send_returned(tiny_checkpoint):
    """Two streams' first chunks share a codec call; the second is sent 0.2 s after the first, and
    the first's time to first audio (and its playback clock) must not include that wait."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    trace = io.StringIO()
    service = TTSService(
        engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1, chunk_trace=trace
    )
    try:
        sinks = [SlowSink(), SlowSink()]
        inputs = fixed_length(b"Sent in turn.", 2)
        with service.lock:  # both admitted in one engine pass: their chunks go in one call
            for name, sink in zip(("r1", "r2"), sinks):
                service.submit(parser.parse(name, inputs), sink)
        assert all(sink.done.wait(120) and sink.errors == [] for sink in sinks)
    finally:
        service.shutdown()
    records = [r for r in map(json.loads, trace.getvalue().splitlines()) if r["kind"] == "chunk"]
    assert [r["batch"] for r in records] == [2, 2]
    first, second = sorted(r["sent"] for r in records)
    assert second - first >= 0.19


def test_a_failed_admission_ends_its_streams_with_an_error_and_the_service_goes_on(tiny_checkpoint):
    """The prefill fails once (a device fault, say): the requests being admitted were in neither of
    the engine's lists by then, and still get an error, not silence; the next request is served."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    slots, runner = pool.rows, engine.runner
    prefill, failures = runner.prefill, [RuntimeError("device fault")]

    def prefill_failing_once(*args):
        if failures:
            raise failures.pop()
        return prefill(*args)

    runner.prefill = prefill_failing_once
    service = TTSService(engine, scheduler_config, {URGENT: InProcessLane(codec, pool.tensor)}, max_queued=1)
    inputs = fixed_length(b"Admitted?", 4)
    try:
        failed, served = CollectingSink(), CollectingSink()
        service.submit(parser.parse("r1", inputs), failed)
        assert failed.done.wait(60) and failed.errors == ["generation failed: device fault"]
        wait_for(lambda: len(service.free_slots) == slots and not service.streams)
        service.submit(parser.parse("r2", inputs), served)
        assert served.done.wait(60) and served.errors == [] and sum(int(i[2]) for i in served.info) == 4
    finally:
        service.shutdown()


def test_a_step_that_fails_after_the_engine_finished_a_request_still_ends_its_stream(tiny_checkpoint):
    """A fault after the engine marked a request finished but before its last frame reached the
    service (a failing row move, say): the stream gets the error instead of waiting forever."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    frames, failures = engine._frames, [RuntimeError("device fault")]

    def frames_then_fault(*args):
        outputs = frames(*args)
        if failures and any(output.finish_reason for output in outputs):
            raise failures.pop()
        return outputs

    engine._frames = frames_then_fault
    service = TTSService(engine, scheduler_config, {URGENT: InProcessLane(codec, pool.tensor)}, max_queued=1)
    inputs = fixed_length(b"Lost at the end.", 4)
    try:
        sink = CollectingSink()
        service.submit(parser.parse("r1", inputs), sink)
        assert sink.done.wait(60) and sink.errors == ["generation failed: device fault"]
        wait_for(lambda: not service.streams)
        assert service.draining == 0
    finally:
        service.shutdown()


class FullDisk:
    def write(self, text):
        raise OSError(28, "No space left on device")


def test_a_failing_chunk_trace_turns_itself_off_and_the_stream_completes(tiny_checkpoint):
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    service = TTSService(
        engine,
        scheduler_config,
        {URGENT: InProcessLane(codec, pool.tensor)},
        max_queued=1,
        chunk_trace=FullDisk(),
    )
    try:
        sink = CollectingSink()
        inputs = fixed_length(b"Traced.", 6)
        service.submit(parser.parse("r1", inputs), sink)
        assert sink.done.wait(60) and sink.errors == [] and len(sink.info) == 3
        assert service.chunk_trace is None
    finally:
        service.shutdown()


class GaugeRecorder(DroppedMetrics):
    """Service metrics that keep the gauges' history (the rest is dropped)."""

    def __init__(self):
        self.gauge_calls = []

    def gauges(self, active, rows, waiting, draining, queues, deadline_misses):
        self.gauge_calls.append((active, rows, waiting, draining))


def test_the_waiting_gauge_counts_requests_no_row_was_free_for(tiny_checkpoint):
    """Two rows, three requests: the third waits for a row while the first two generate, and the
    gauges say so (and that no row is in use once all three are done)."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    metrics = GaugeRecorder()
    service = TTSService(
        engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1, metrics=metrics
    )
    try:
        sinks = [CollectingSink() for _ in range(3)]
        inputs = fixed_length(b"Wait for a row.", 12, seed=4)
        for index, sink in enumerate(sinks):
            service.submit(parser.parse(f"r{index}", inputs), sink)
        assert all(sink.done.wait(120) and sink.errors == [] for sink in sinks)
        wait_for(lambda: metrics.gauge_calls[-1] == (0, 0, 0, 0))
    finally:
        service.shutdown()
    assert max(waiting for _, _, waiting, _ in metrics.gauge_calls) == 1
    assert max(rows for _, rows, _, _ in metrics.gauge_calls) == 2
    assert all(rows + waiting + draining <= active for active, rows, waiting, draining in metrics.gauge_calls)


@pytest.mark.parametrize(
    "policy, lane_workers, in_flight",
    [
        ("voxserve", 2, 2 * (16 + 64)),  # two workers on each of two lanes
        ("concurrent", 2, 2 * 16),  # one lane: no background batches to hold rows for
        ("serial", 2, 16),  # one inline decode at a time, on the engine thread
    ],
)
def test_the_codec_state_pool_holds_a_batch_per_worker_of_each_lane_the_policy_uses(
    tiny_checkpoint, policy, lane_workers, in_flight
):
    engine, _, scheduler_config = engine_and_parser(tiny_checkpoint, policy)
    assert (scheduler_config.max_batch, scheduler_config.background_max_batch) == (16, 64)
    assert codec_slots(engine, 3, scheduler_config, lane_workers) == engine.max_running + 3 + in_flight


class LaneHeldUntilReleased:
    """An in-process codec lane whose calls wait until the test releases them."""

    def __init__(self, codec: CodecService, pool: torch.Tensor):
        self.lane, self.release, self.called = (
            InProcessLane(codec, pool),
            threading.Event(),
            threading.Event(),
        )
        self.slots_in_call: list[int] = []  # the codec state rows of the latest call

    def decode(self, codes, start, slots, prime=False):
        self.slots_in_call = slots.tolist()
        self.called.set()
        self.release.wait(60)
        return self.lane.decode(codes, start, slots, prime)


@pytest.mark.parametrize("catch_up, sizes", [(True, [2, 8, 3]), (False, [2, 2, 4, 4, 1])])
def test_chunks_catch_up_with_a_generation_that_ran_ahead_and_the_audio_stays_exact(
    tiny_checkpoint, catch_up, sizes
):
    """The lane holds the first chunk until all 13 frames are generated. With catch-up the second
    chunk takes the largest size of 2,2,4,4,8 that the 11 waiting frames fill (8), the last the 3 left
    (padded to 8); without it, the schedule. The audio is the whole decode's either way."""
    engine, parser, scheduler_config = engine_and_parser(
        tiny_checkpoint, "concurrent", chunk_schedule="2,2,4,4,8", catch_up=catch_up
    )
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = LaneHeldUntilReleased(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    try:
        sink = CollectingSink()
        inputs = fixed_length(b"Generation runs ahead.", 13, seed=7)
        service.submit(parser.parse("r1", inputs), sink)
        assert lane.called.wait(60)  # the first chunk is out
        wait_for(lambda: service.scheduler.streams["r1"].generation_done)
        lane.release.set()
        assert sink.done.wait(120) and sink.errors == []
    finally:
        service.shutdown()
    assert [int(info[2]) for info in sink.info] == sizes
    assert_audio_is_the_whole_decode(codec, sink, 13)


def test_streams_that_finished_generating_do_not_take_the_rows_of_new_requests(tiny_checkpoint):
    """A stream whose generation has ended, its audio still owed, holds a codec state row but no
    KV-cache row: new requests are refused for lack of rows or queue places only by the streams
    generating or waiting, and for lack of codec rows once `max_draining` (plus the lanes' in-flight
    reserve) is used up; each refusal names its limit and counts who holds the rows, and every
    admitted stream completes."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", max_batch=1)
    codec = CodecService(CodecSettings(checkpoint_dir=str(tiny_checkpoint), device="cpu"))
    slots = codec_slots(engine, 0, scheduler_config, max_draining=2)
    assert slots == 2 + 0 + 2 + 1  # two rows, no queue, two draining, one chunk in flight on the one lane
    pool = CodecStatePool(slots, codec.state_size, "cpu")
    lane, metrics = LaneHeldUntilReleased(codec, pool.tensor), GaugeRecorder()
    service = TTSService(
        engine,
        scheduler_config,
        {URGENT: lane},
        max_queued=0,
        max_draining=2,
        cancellation_check_s=0.01,
        metrics=metrics,
    )
    sinks: dict[str, CollectingSink] = {}

    def submit(request_id: str, frames: int) -> None:
        sink = CollectingSink()
        inputs = fixed_length(b"Still playing.", frames)
        service.submit(parser.parse(request_id, inputs), sink)
        sinks[request_id] = sink

    def pool_full(in_flight: int, draining: str) -> str:
        return (
            rf"codec state pool full: all 5 rows held \([01] streams generating or queued, "
            rf"{draining} draining \(generated, audio still owed\), {in_flight} by ended streams whose "
            rf"chunk a lane is still decoding\); raise max_draining \(now 2\)"
        )

    try:
        submit("short1", 4)
        submit("short2", 4)
        wait_for(lambda: service.draining == 2)  # generated; their chunks wait in the held lane
        submit("long1", 40)  # the rows are free again
        submit("long2", 40)
        with pytest.raises(
            ServerBusy,
            match=r"2 streams generating or queued \(max_streams 2 \+ max_queued 0; "
            r"[0-2] of them not started yet\)",
        ):
            submit("refused_for_rows", 4)
        wait_for(lambda: service.draining == 4)
        wait_for(
            lambda: metrics.gauge_calls[-1] == (4, 0, 0, 4)
        )  # four held, all draining: no row, none waiting
        submit("last_codec_row", 4)  # the fifth: the in-flight reserve's row
        with pytest.raises(ServerBusy, match=pool_full(0, "[45]")):
            submit("refused_for_codec_rows", 4)
        # The stream whose chunk the lane holds is cancelled: it leaves, its row stays held by the call.
        assert lane.called.wait(60)
        with service.lock:
            in_call = next(rid for rid, s in service.streams.items() if s.codec_slot in lane.slots_in_call)
        sinks[in_call].cancel = True
        wait_for(lambda: in_call not in service.streams)
        with pytest.raises(ServerBusy, match=pool_full(1, "[34]")):
            submit("refused_for_a_row_in_flight", 4)
        lane.release.set()
        for request_id, sink in sinks.items():
            assert sink.done.wait(60)
            assert sink.errors == (["request cancelled"] if request_id == in_call else [])
        wait_for(lambda: not service.streams and service.draining == 0 and len(service.free_slots) == slots)
    finally:
        lane.release.set()
        service.shutdown()


def test_a_late_frame_of_an_ended_request_does_not_touch_a_new_stream_under_its_id(tiny_checkpoint):
    """A request is cancelled and a client reuses its id at once: a last frame of the old request,
    from a step already in flight, must not join the new stream, mark it generated or count it as
    draining."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent")
    lane = LaneThatFailsAfterCancellation()  # holds the first call: nothing is decoded meanwhile
    service = TTSService(engine, scheduler_config, {URGENT: lane}, max_queued=1, cancellation_check_s=0.01)
    inputs = fixed_length(b"Reused id.", 40)
    try:
        old_request, old_sink = parser.parse("r1", inputs), CancellableSink()
        service.submit(old_request, old_sink)
        assert lane.called.wait(60)
        old_sink.cancel = True
        wait_for(lambda: "r1" not in service.streams)
        service.submit(parser.parse("r1", inputs), CancellableSink())
        with service.lock:
            stream = service.streams["r1"]
            before = (len(stream.frames), stream.generation_done, service.draining)
            service._on_frame(old_request, np.zeros(16, dtype=np.int64), "max_frames")
            assert (len(stream.frames), stream.generation_done, service.draining) == before
    finally:
        lane.release.set()
        service.shutdown()


class CountingLane:
    """An in-process codec lane that counts its calls."""

    def __init__(self, lane):
        self.lane, self.calls = lane, 0

    def decode(self, codes, start, slots, prime=False):
        self.calls += 1
        return self.lane.decode(codes, start, slots, prime)


class EveryUpdateRecorder(DroppedMetrics):
    """Service metrics that keep every update but the gauges, by name."""

    def __init__(self):
        self.updates = []

    def chunk_sent(self, *args, **kwargs):
        self.updates.append("chunk_sent")

    def codec_call(self, *args):
        self.updates.append("codec_call")

    def frame_step(self, *args):
        self.updates.append("frame_step")


def test_the_warm_up_decodes_on_every_lane_records_nothing_and_leaves_the_service_as_new(tiny_checkpoint):
    """voxserve's warm-up pins one stream to each lane: both lanes decode, while neither the metrics
    nor the chunk trace hear of it; afterwards the scheduler is fresh, every codec row free, and a
    client's request is served and recorded as usual."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "voxserve", chunk_schedule="2,4")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    # A codec of its own per lane, as each lane is a process of its own in the server.
    other_codec = CodecService(CodecSettings(checkpoint_dir=str(tiny_checkpoint), device="cpu"))
    lanes = {
        URGENT: CountingLane(InProcessLane(codec, pool.tensor)),
        BACKGROUND: CountingLane(InProcessLane(other_codec, pool.tensor)),
    }
    metrics, trace = EveryUpdateRecorder(), io.StringIO()
    service = TTSService(engine, scheduler_config, lanes, max_queued=1, metrics=metrics, chunk_trace=trace)
    inputs = fixed_length(b"Warm every lane.", 6, seed=0)
    try:
        warm_up_requests = {lane: parser.parse(f"warmup-{lane}", inputs) for lane in (URGENT, BACKGROUND)}
        service.warm_up(warm_up_requests, timeout=120)
        assert lanes[URGENT].calls >= 2 and lanes[BACKGROUND].calls >= 2  # each stream's chunks, 2 and 4
        assert metrics.updates == [] and trace.getvalue() == ""
        assert service.streams == {} and service.scheduler.streams == {}
        assert service.scheduler.routed == {URGENT: 0, BACKGROUND: 0, INLINE: 0}
        assert len(service.free_slots) == codec_slots(engine, 1, scheduler_config)
        sink = CollectingSink()
        service.submit(parser.parse("r1", inputs), sink)
        assert sink.done.wait(120) and sink.errors == []
        assert sum(len(audio) for audio in sink.audio) == 6 * 1920
        wait_for(lambda: metrics.updates.count("chunk_sent") == 2)
        assert "frame_step" in metrics.updates and '"kind": "chunk"' in trace.getvalue()
    finally:
        service.shutdown()


@pytest.fixture(scope="module")
def base_encoder(tiny_base_checkpoint):
    return VoiceEncoder(load_family(tiny_base_checkpoint))


class RecordingLane:
    """A codec lane that notes each call's first start and frame count, one call at a time."""

    def __init__(self, lane):
        self.lane, self.calls, self.lock = lane, [], threading.Lock()
        self.primed = threading.Event()

    def decode(self, codes, start, slots, prime=False):
        with self.lock:
            self.calls.append((int(start[0]), codes.shape[1], prime))
            audio = self.lane.decode(codes, start, slots, prime)
        if prime:
            self.primed.set()
        return audio


@pytest.mark.parametrize("policy", ["voxserve", "serial"])
def test_an_in_context_stream_is_primed_while_it_prefills(tiny_base_checkpoint, base_encoder, policy):
    """With lane workers (voxserve) the urgent lane primes an in-context voice's codec state as soon
    as the request is submitted: the engine's first step here waits for that (10 s at most), so the
    priming comes before any frame. serial has no lane workers and primes at the first chunk. Either
    way the codec sees one priming call, and the audio is what decoding the reference codes and the
    generated ones in one piece gives after the reference's samples."""
    engine, parser, scheduler_config = engine_and_parser(tiny_base_checkpoint, policy, chunk_schedule="2,4,8")
    codec, pool = cpu_codec(tiny_base_checkpoint, engine, scheduler_config)
    lane = RecordingLane(InProcessLane(codec, pool.tensor))
    noise = np.random.default_rng(3).standard_normal(36000)
    recording = (0.3 * np.sin(np.arange(36000) * 0.05) + 0.05 * noise).astype(np.float32)
    voice = base_encoder.encode([recording], ["A reference, spoken."])[0]
    step, primed_before_the_first_step = engine.step, []

    def first_step_waits_for_the_priming(**options):
        if not primed_before_the_first_step:
            primed_before_the_first_step.append(lane.primed.wait(10))
        return step(**options)

    if policy == "voxserve":
        engine.step = first_step_waits_for_the_priming
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    sink = speak(service, parser.parse("r1", fixed_length(b"Primed ahead.", 10, seed=5), voice))
    frames = len(voice.codes)
    assert [call for call in lane.calls if call[2]] == [(0, frames, True)]
    assert primed_before_the_first_step == ([True] if policy == "voxserve" else [])
    codes = np.concatenate([voice.codes, np.concatenate(sink.codes)])
    whole, _ = codec.model.decode(
        torch.from_numpy(codes)[None].long(), torch.zeros(1, dtype=torch.long), codec.model.new_state(1)
    )
    assert np.abs(np.concatenate(sink.audio) - whole[0, frames * 1920 :].float().numpy()).max() <= 1e-4


class LaneThatHoldsThePriming(RecordingLane):
    """Its priming call (the reference codes) waits for `release`."""

    def __init__(self, lane):
        super().__init__(lane)
        self.priming, self.release = threading.Event(), threading.Event()

    def decode(self, codes, start, slots, prime=False):
        if prime:
            self.priming.set()
            self.release.wait(60)
        return super().decode(codes, start, slots, prime)


def test_a_stream_ended_while_it_is_primed_keeps_its_row_until_the_priming_returns(
    tiny_base_checkpoint, base_encoder
):
    engine, parser, scheduler_config = engine_and_parser(tiny_base_checkpoint, "voxserve")
    codec, pool = cpu_codec(tiny_base_checkpoint, engine, scheduler_config)
    lane = LaneThatHoldsThePriming(InProcessLane(codec, pool.tensor))
    recording = (0.3 * np.sin(np.arange(30000) * 0.05)).astype(np.float32)
    voice = base_encoder.encode([recording], ["Words."])[0]
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    try:
        slots = len(service.free_slots)
        inputs = {"text": np.array([b"Ended early."], dtype=object), "max_frames": np.array([40])}
        sink = CollectingSink()
        service.submit(parser.parse("r1", inputs, voice), sink)
        assert lane.priming.wait(60)
        service.end_stream("r1", "request cancelled")
        assert sink.errors == ["request cancelled"] and len(service.free_slots) == slots - 1
        lane.release.set()
        wait_for(lambda: len(service.free_slots) == slots)
    finally:
        lane.release.set()
        service.shutdown()


class LaneThatHoldsItsFirstCall(RecordingLane):
    def __init__(self, lane):
        super().__init__(lane)
        self.holding, self.release, self.first = threading.Event(), threading.Event(), True

    def decode(self, codes, start, slots, prime=False):
        if self.first:
            self.first = False
            self.holding.set()
            self.release.wait(60)
        return super().decode(codes, start, slots, prime)


def test_a_stream_ended_before_its_priming_started_gives_its_row_back_at_once(
    tiny_base_checkpoint, base_encoder
):
    """The urgent lane's one worker is busy with another stream's chunk, so a new in-context stream's
    priming waits in the queue; ended meanwhile, it leaves the queue and frees its row at once, and
    the codec never primes it."""
    engine, parser, scheduler_config = engine_and_parser(tiny_base_checkpoint, "voxserve")
    codec, pool = cpu_codec(tiny_base_checkpoint, engine, scheduler_config)
    lane = LaneThatHoldsItsFirstCall(InProcessLane(codec, pool.tensor))
    recording = (0.3 * np.sin(np.arange(30000) * 0.05)).astype(np.float32)
    voice = base_encoder.encode([recording], ["Words."])[0]
    x_vector = base_encoder.encode([recording], [None])[0]
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    try:
        slots = len(service.free_slots)
        inputs = {"text": np.array([b"Busy lane."], dtype=object), "max_frames": np.array([20])}
        first = CollectingSink()
        service.submit(parser.parse("r1", inputs, x_vector), first)
        assert lane.holding.wait(60)  # r1's first chunk holds the urgent worker
        service.submit(parser.parse("r2", inputs, voice), CollectingSink())
        assert list(service.primings) == [service.streams["r2"]]
        service.end_stream("r2", "request cancelled")
        assert not service.primings and len(service.free_slots) == slots - 1  # r1 holds one
        lane.release.set()
        assert first.done.wait(120) and first.errors == []
        wait_for(lambda: len(service.free_slots) == slots)
        assert not any(prime for _, _, prime in lane.calls)
    finally:
        lane.release.set()
        service.shutdown()


def test_a_stream_ended_before_the_engine_took_it_is_never_scheduled(tiny_checkpoint):
    """Ended while it waits for the engine loop's next pass (an input stream's timeout, say): the
    loop skips it, so it holds no KV row and the chunk scheduler never tracks it."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "voxserve")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    inputs = {"text": np.array([b"Never spoken."], dtype=object), "max_frames": np.array([8])}
    try:
        ended, later = CollectingSink(), CollectingSink()
        with service.lock:  # the loop takes submitted streams under this lock: not before it is free
            service.submit(parser.parse("ended", inputs), ended)
            service.end_stream("ended", "sequence timed out")
        assert ended.done.wait(10) and ended.errors == ["sequence timed out"]
        service.submit(parser.parse("later", inputs), later)  # a pass after the ended stream's
        assert later.done.wait(120) and later.errors == []
        assert "ended" not in service.scheduler.streams
        wait_for(lambda: not service.streams and not engine.running)
    finally:
        service.shutdown()
    with pytest.raises(ServerBusy, match="server shutting down"):  # a voice encoded too late, say
        service.submit(parser.parse("late", inputs), CollectingSink())


class SinkThatCannotSend(CollectingSink):
    """Its first send fails on the server's side (say, shared memory full), its client still there."""

    def send(self, audio, codes, info, final):
        raise RuntimeError("Failed to increase the shared memory pool size")


class MetricsThatFailOnce(DroppedMetrics):
    """A bug after a codec call (here: in recording the first chunk sent)."""

    def __init__(self):
        self.failed = False

    def chunk_sent(self, *args, **kwargs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the metrics")


def test_a_failed_send_or_a_bug_after_the_codec_call_ends_the_stream_with_an_error(tiny_checkpoint):
    """Not silently: a send that fails reaches the client as an error, if it is still there; a bug
    past the codec call ends its batch's streams with it, gives their rows back, and the lane
    worker goes on to serve the next request."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(
        engine, scheduler_config, {URGENT: lane}, max_queued=1, metrics=MetricsThatFailOnce()
    )
    inputs = fixed_length(b"Ends.", 6)
    try:
        slots = len(service.free_slots)
        cannot_send = SinkThatCannotSend()
        service.submit(parser.parse("r1", inputs), cannot_send)
        assert cannot_send.done.wait(60)
        assert cannot_send.errors == [
            "sending its audio failed: Failed to increase the shared memory pool size"
        ]
        hit_by_the_bug, after = CollectingSink(), CollectingSink()
        service.submit(parser.parse("r2", inputs), hit_by_the_bug)
        assert hit_by_the_bug.done.wait(60)
        assert hit_by_the_bug.errors == ["codec lane 'urgent' failed: a bug in the metrics"]
        service.submit(parser.parse("r3", inputs), after)
        assert after.done.wait(60) and after.errors == [] and len(after.info) == 3
        wait_for(lambda: len(service.free_slots) == slots and not service.streams)
    finally:
        service.shutdown()


def test_the_service_threads_outlive_a_bug_in_their_own_error_paths(tiny_checkpoint, monkeypatch):
    """A bug choosing a lane's next batch, and a failed step whose clean-up fails too: each thread
    logs it and goes on, so the next request still gets its audio (a dead thread would leave every
    later stream without its final response)."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    service = TTSService(engine, scheduler_config, {URGENT: lane}, max_queued=1)
    inputs = fixed_length(b"Goes on.", 6)
    faults = {"next_batch": 1, "step": 1, "abort": 1}

    def once(name, method):
        def faulty(*args, **kwargs):
            if faults[name]:
                faults[name] -= 1
                raise RuntimeError(f"a bug in {name}")
            return method(*args, **kwargs)

        return faulty

    try:
        monkeypatch.setattr(service.scheduler, "next_batch", once("next_batch", service.scheduler.next_batch))
        monkeypatch.setattr(engine, "abort", once("abort", engine.abort))
        first = CollectingSink()
        service.submit(parser.parse("r1", inputs), first)
        assert first.done.wait(60) and first.errors == [] and len(first.info) == 3
        assert faults["next_batch"] == 0
        monkeypatch.setattr(engine, "step", once("step", engine.step))
        failed, after = CollectingSink(), CollectingSink()
        service.submit(parser.parse("r2", inputs), failed)
        assert failed.done.wait(60) and failed.errors == ["generation failed: a bug in step"]
        assert faults == {"next_batch": 0, "step": 0, "abort": 0}
        service.submit(parser.parse("r3", inputs), after)
        assert after.done.wait(60) and after.errors == [] and len(after.info) == 3
    finally:
        service.shutdown()


def test_a_bug_in_one_chunks_bookkeeping_ends_that_chunks_stream_alone(tiny_checkpoint):
    """Two first chunks in one codec call, the first's metrics failing: its stream ends with the
    error, the other's goes on to its end (its next chunk, cut already, may be on another worker)."""
    engine, parser, scheduler_config = engine_and_parser(tiny_checkpoint, "concurrent", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_checkpoint, engine, scheduler_config)
    lane = InProcessLane(codec, pool.tensor)
    metrics = MetricsThatFailOnce()
    service = TTSService(engine, scheduler_config, {URGENT: lane}, max_queued=1, metrics=metrics)
    inputs = fixed_length(b"Two.", 6)
    try:
        slots = len(service.free_slots)
        sinks = [CollectingSink(), CollectingSink()]
        with service.lock:  # both in the engine's first step, so their first chunks share a batch
            for index, sink in enumerate(sinks):
                service.submit(parser.parse(f"r{index}", inputs), sink)
        assert all(sink.done.wait(60) for sink in sinks) and metrics.failed
        errors = sorted(sink.errors for sink in sinks)
        assert errors == [[], ["codec lane 'urgent' failed: a bug in the metrics"]]
        assert [len(sink.info) for sink in sinks if not sink.errors] == [3]
        wait_for(lambda: len(service.free_slots) == slots and not service.streams)
    finally:
        service.shutdown()


class LaneThatCannotPrime(RecordingLane):
    """Its priming calls fail."""

    def decode(self, codes, start, slots, prime=False):
        if prime:
            raise RuntimeError("out of memory")
        return super().decode(codes, start, slots, prime)


def test_a_stream_whose_priming_fails_ends_alone(tiny_base_checkpoint, base_encoder):
    """serial primes an in-context stream at its first chunk, in the batch of the first chunks: the
    one whose priming fails ends with the error, the x-vector stream beside it streams its audio."""
    engine, parser, scheduler_config = engine_and_parser(tiny_base_checkpoint, "serial", chunk_schedule="2")
    codec, pool = cpu_codec(tiny_base_checkpoint, engine, scheduler_config)
    lane = LaneThatCannotPrime(InProcessLane(codec, pool.tensor))
    recording = (0.3 * np.sin(np.arange(30000) * 0.05)).astype(np.float32)
    in_context, x_vector = base_encoder.encode([recording] * 2, ["Words.", None])
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1)
    inputs = fixed_length(b"Side by side.", 6)
    try:
        primed, plain = CollectingSink(), CollectingSink()
        with service.lock:  # both in the engine's first step, so their first chunks share a batch
            service.submit(parser.parse("r1", inputs, in_context), primed)
            service.submit(parser.parse("r2", inputs, x_vector), plain)
        assert primed.done.wait(120) and plain.done.wait(120)
        assert primed.errors == ["codec lane 'inline' failed: out of memory"] and primed.audio == []
        assert plain.errors == [] and len(plain.info) == 3
        assert (0, 2, False) in lane.calls
    finally:
        service.shutdown()
