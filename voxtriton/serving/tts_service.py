"""The `tts` scheduler model's work, without Triton types: engine loop, chunking, codec lanes.

Threads:
- the caller (Triton's execute) submits requests and returns at once (decoupled model);
- the engine thread admits requests, runs one frame step for every running request, and hands the
  frames to the chunk scheduler, which cuts chunks and queues them on a lane;
- each codec lane's workers (`lane_workers`, two in the server) take a batch from its queue, call the
  codec (BLS in the server), send each chunk's audio to its stream (without the service lock), and
  let the scheduler cut that stream's next chunk;
- a watcher polls the clients' cancellation flags (a round trip to the server process each, so
  not on the engine thread, whose every millisecond delays every stream).
A stream has at most one chunk in flight (the next one continues the codec state this one leaves in
the stream's row of the codec state pool), so its chunks leave in order and exactly once, whichever
lanes decode them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol, TextIO

import numpy as np
import torch

from ..engine.engine import Engine, StepTiming
from ..engine.request import Request
from ..errors import ServerBusy
from ..scheduler.policy import BACKGROUND, INLINE, URGENT, Chunk, ChunkScheduler, SchedulerConfig

log = logging.getLogger(__name__)

LANE_CODES = {URGENT: 0, BACKGROUND: 1, INLINE: 2}
# The longest the cancellation watcher keeps the service lock at once, which the engine thread or a
# lane may wait out; it finishes the check in progress, so a hold is at least one check. A check took
# 80-245 us on session 23's H200 hosts and 110-130 on CPU (benchmarks/response_sends.py), so a hold is
# a few checks; a fixed count of 8 held the lock 0.6-2 ms there.
MAX_HOLD_S = 0.001


class CodecLane(Protocol):
    def decode(self, codes: torch.Tensor, start: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] int32, start [B] int64, slots [B] int64 (rows of the codec state pool)
        -> audio [B, N] fp32 on the CPU."""


class ResponseSink(Protocol):
    def send(self, audio: torch.Tensor, codes: np.ndarray, info: np.ndarray, final: bool) -> None:
        """One chunk of one stream: audio [N] fp32 CPU, codes [T, Q], info [chunk, first frame, frames, lane].
        Called without the service lock, possibly after the stream was failed or cancelled: a sink
        that already sent its final response (or error) drops the chunk."""

    def fail(self, message: str) -> None:
        """End the stream with an error."""

    def cancelled(self) -> bool:
        """The client cancelled or went away (False once the final response or error was sent).
        Called from the cancellation watcher, under the service lock."""


@dataclass(eq=False)
class Stream:
    request: Request
    sink: ResponseSink
    submitted_at: float
    codec_slot: (
        int | None
    )  # row of the codec state pool, held until the stream ends and no chunk is in flight
    frames: list[np.ndarray] = field(default_factory=list)
    ended: bool = False
    decoding: bool = False  # a chunk of this stream is in a codec lane
    generated: bool = False  # its last frame reached the service (the engine may finish a request earlier)
    lane: str | None = None  # pins every chunk to one lane (warm-up)


class WarmupSink:
    """Takes a warm-up stream's chunks and drops them; `done` is set at its end."""

    def __init__(self):
        self.done, self.error = threading.Event(), None

    def send(self, audio, codes, info, final):
        if final:
            self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()

    def cancelled(self):
        return False


class ServiceMetrics(Protocol):
    def chunk_sent(
        self,
        lane: str,
        frames: int,
        decode_s: float,
        first: bool,
        since_submit_s: float,
        promoted: bool = False,
    ) -> None:
        """A chunk's audio was sent; `promoted`: it waited for the background lane until its slack ran
        out and was decoded on the urgent lane instead."""

    def codec_call(self, lane: str, frames: int, seconds: float) -> None:
        """One decode call on `lane`, of `frames` frames in all (padding included)."""

    def rejected(self) -> None: ...
    def cancellation_checks(self, streams: int, seconds: float) -> None:
        """The cancellation watcher checked `streams` streams in one hold of the service lock,
        held `seconds`: the engine and the lanes wait that long for it."""

    def frame_step(self, seconds: float, batch: int, timing: StepTiming, host_cpu_s: float) -> None:
        """One pass of the engine loop that generated a frame for `batch` streams: `seconds` is the
        pass's whole wall time (the frame period while busy), `timing` splits out admission and decode,
        `host_cpu_s` is the engine thread's CPU time in the pass outside the decode."""

    def gauges(
        self,
        active: int,
        rows: int,
        waiting: int,
        draining: int,
        queues: dict[str, int],
        deadline_misses: int,
    ) -> None:
        """Streams held, rows generating, requests waiting for a free row, streams draining
        (generated, audio still owed), chunks waiting per lane."""


def codec_slots(
    engine: Engine,
    max_queued: int,
    scheduler_config: SchedulerConfig,
    lane_workers: int = 1,
    max_draining: int = 0,
) -> int:
    """Rows the codec state pool needs: one per stream the service holds (generating, waiting for a
    row, or draining: generated, its audio still owed), plus the rows of streams that ended while a
    lane was decoding their chunk (up to one batch per worker of each lane the policy uses; serial's
    one inline decode at a time; freed on return)."""
    workers = 1 if scheduler_config.rules.inline_decode else lane_workers
    in_flight = sum(scheduler_config.batch_limit(lane) for lane in scheduler_config.lanes)
    return engine.max_running + max_queued + max_draining + workers * in_flight


def padded_codes(frames: list[np.ndarray], length: int) -> np.ndarray:
    """A chunk's frames [T, Q], the last one repeated up to `length` (see `Chunk.decode_frames`)."""
    codes = np.stack(frames)
    return np.concatenate([codes, np.repeat(codes[-1:], length - len(codes), axis=0)])


class TTSService:
    def __init__(
        self,
        engine: Engine,
        scheduler_config: SchedulerConfig,
        lanes: dict[str, CodecLane],
        max_queued: int,
        cancellation_check_s: float = 0.2,
        metrics: ServiceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        device: torch.device | str = "cpu",
        engine_context=None,
        chunk_trace: TextIO | None = None,
        lane_workers: int = 1,
        max_draining: int = 0,
        cancellation_lock_share: float = 1.0,
    ):
        """lanes share one codec state pool of at least `codec_slots(...)` rows. `chunk_trace`, if
        given, gets one JSON line per chunk sent and per frame step (see `_write_trace`).
        `lane_workers`: codec calls each lane keeps in flight; the server passes
        `TTSSettings.lane_workers` (2), direct users get one unless they ask. `max_draining`: codec
        state rows added to the shared pool for streams that have finished generating and still owe
        audio (not a cap of its own: see `submit`). `cancellation_lock_share`: the largest share of
        time the cancellation watcher holds the service lock (`_watch_cancellations`); the server
        passes `TTSSettings.cancellation_lock_share` (0.1), direct users get no pacing unless they ask."""
        self.engine = engine
        self.scheduler = ChunkScheduler(scheduler_config, clock)
        self.lanes = lanes
        self.device = torch.device(device)
        # Entered by the engine thread: the backbone's SM partition on a GPU, else a stream of its own,
        # so nothing the lane workers queue waits behind a frame step.
        self.engine_context = engine_context or self._own_stream()
        self.max_queued = max_queued
        self.cancellation_check_s = cancellation_check_s
        if not 0 < cancellation_lock_share <= 1:
            raise ValueError(
                f"cancellation_lock_share must be above 0 and at most 1, got {cancellation_lock_share}"
            )
        self.cancellation_lock_share = cancellation_lock_share
        self.metrics = metrics
        self.clock = clock
        self.chunk_trace = chunk_trace
        self.lock = threading.Condition()
        self.incoming: list[Stream] = []
        self.streams: dict[str, Stream] = {}
        if max_draining < 0:
            raise ValueError(f"max_draining must be 0 or more, got {max_draining}")
        self.codec_pool_rows = codec_slots(engine, max_queued, scheduler_config, lane_workers, max_draining)
        self.free_slots = list(range(self.codec_pool_rows))
        self.max_draining = max_draining
        self.draining = 0  # streams in `streams` whose last frame has reached the service
        self.lane_clock_lock = threading.Lock()  # not the service lock: taken the moment a call returns
        self.lane_free_at: dict[str, float] = {}  # when each lane's latest call ended (see `_call_span`)
        self.running = True
        self.engine_idle = False  # the engine thread waits for work, its previous pass all done
        self._stopping = threading.Event()  # wakes the cancellation watcher at shutdown
        self.threads = [
            threading.Thread(target=self._engine_loop, name="voxtriton-engine", daemon=True),
            threading.Thread(target=self._watch_cancellations, name="voxtriton-cancellations", daemon=True),
        ]
        if not scheduler_config.rules.inline_decode:
            self.threads += [
                threading.Thread(
                    target=self._lane_loop, args=(lane,), name=f"voxtriton-{lane}-{worker}", daemon=True
                )
                for lane in scheduler_config.lanes
                for worker in range(lane_workers)
            ]
        for thread in self.threads:
            thread.start()

    def _own_stream(self):
        """A CUDA stream for the calling thread's work (a no-op context on CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    # -- submission ------------------------------------------------------------------------------

    def submit(self, request: Request, sink: ResponseSink, lane: str | None = None) -> None:
        """Queue a request; its chunks stream to `sink`. `lane` pins them to one lane (warm-up)."""
        with self.lock:
            waiting = len(self.incoming) + len(self.engine.waiting)
            if request.request_id in self.streams:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            # A stream whose generation has ended needs no KV-cache row any more, only its codec state
            # row until its last chunk is sent, so it no longer counts against max_streams +
            # max_queued: on the H200 (session 19) voxserve, whose streams stayed held longer (median
            # RTF 0.33-0.50 against concurrent's 0.20-0.28), was refused at 116 req/s with 768 streams
            # held while at most 448 rows were in use. Draining streams share the codec pool instead.
            generating_or_queued = len(self.streams) - self.draining
            busy = None
            if generating_or_queued >= self.engine.max_running + self.max_queued:
                busy = (
                    f"{generating_or_queued} streams generating or queued (max_streams {self.engine.max_running} "
                    f"+ max_queued {self.max_queued}; {waiting} of them not started yet)"
                )
            elif not self.free_slots:
                # Each open stream holds one row; the rest belong to ended streams a lane still decodes.
                in_flight = self.codec_pool_rows - len(self.free_slots) - len(self.streams)
                busy = (
                    f"codec state pool full: all {self.codec_pool_rows} rows held ({generating_or_queued} "
                    f"streams generating or queued, {self.draining} draining (generated, audio still owed), "
                    f"{in_flight} by ended streams whose chunk a lane is still decoding); raise max_draining "
                    f"(now {self.max_draining}) for more"
                )
            if busy:
                if self.metrics:
                    self.metrics.rejected()
                raise ServerBusy(f"server busy: {busy}; retry later")
            stream = Stream(request, sink, self.clock(), self.free_slots.pop(), lane=lane)
            self.streams[request.request_id] = stream
            self.incoming.append(stream)
            self.lock.notify_all()

    def warm_up(self, requests: dict[str, Request], timeout: float) -> None:
        """Run one request per lane, each pinned to its lane, to its end before serving, so that the
        first client's request finds every code path warm. Raises if one fails or times out. The
        metrics and the chunk trace see none of it (the cancellation watcher may count a check of a
        warm-up stream), and the scheduler starts afresh after it."""
        metrics, trace = self.metrics, self.chunk_trace
        self.metrics = self.chunk_trace = None
        sinks = {lane: WarmupSink() for lane in requests}
        try:
            for lane, request in requests.items():
                self.submit(request, sinks[lane], lane=lane)
            deadline = time.monotonic() + timeout
            for lane, sink in sinks.items():
                if not sink.done.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"warm-up: the {lane} lane's stream did not end within {timeout:g} s")
                if sink.error is not None:
                    raise RuntimeError(f"warm-up: the {lane} lane's stream failed: {sink.error}")
            with self.lock:  # until the engine's last pass (and its metrics call) is over
                while self.running and (self.streams or not self.engine_idle):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"warm-up: the engine did not go idle within {timeout:g} s")
                    self.lock.wait(0.05)
        finally:
            with self.lock:
                for stream in list(self.streams.values()):
                    if isinstance(stream.sink, WarmupSink):
                        self._end(stream, "warm-up ended")
                self.incoming = [stream for stream in self.incoming if not stream.ended]
                self.scheduler = ChunkScheduler(self.scheduler.config, self.clock)
                self.metrics, self.chunk_trace = metrics, trace

    def shutdown(self, timeout: float = 5.0) -> None:
        with self.lock:
            self.running = False
            self.lock.notify_all()
        self._stopping.set()
        for thread in self.threads:
            thread.join(timeout)
        with self.lock:
            for stream in list(self.streams.values()):
                self._end(stream, "server shutting down")

    # -- engine thread -----------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        with self.engine_context:
            self._run_engine()

    def _run_engine(self) -> None:
        while self.running:
            try:
                self._engine_iteration()
            except Exception as error:  # a bug or device fault: fail the running streams, keep serving
                log.error("engine iteration failed: %s", traceback.format_exc())
                self._fail_all_running(f"generation failed: {error}")

    def _engine_iteration(self) -> None:
        # The pass's wall time includes waiting for the lock, which lane workers and the cancellation
        # watcher hold. Its CPU time on this thread, next to the wall time outside the decode, tells
        # waiting (for the GIL, the lock, a CPU) from work: the H200 hosts of sessions 20-22 differed
        # 1.4-5x in those parts (goodput_h200.md, session 22).
        started, cpu_started = time.perf_counter(), time.thread_time()
        with self.lock:
            while self.running and not self.incoming and not self.engine.has_work:
                self.engine_idle = True
                self.lock.wait(0.5)  # woken by submit; the timeout only refreshes the gauges
                self._publish_gauges()
                started, cpu_started = (
                    time.perf_counter(),
                    time.thread_time(),
                )  # idle time is not part of a frame step
            self.engine_idle = False
            if not self.running:
                return
            for stream in self.incoming:
                try:
                    self.engine.add(stream.request)
                except ValueError as error:
                    self._end(stream, str(error))
                    continue
                self.scheduler.open(stream.request.request_id, stream.submitted_at, stream.lane)
            self.incoming.clear()
        outputs = self.engine.step()
        with self.lock:
            for output in outputs:
                self._on_frame(output.request, output.codes, output.finish_reason)
            self._publish_gauges()
            self.lock.notify_all()
        if self.scheduler.config.rules.inline_decode:
            self._drain_inline()  # part of the pass (its time counts as "other"): the codec takes its turn
        period, timing = time.perf_counter() - started, self.engine.last_timing
        host_cpu = time.thread_time() - cpu_started - timing.decode_cpu_s
        if self.metrics and outputs:
            self.metrics.frame_step(period, len(outputs), timing, host_cpu)
        if self.chunk_trace and (outputs or timing.batch):  # with overlap, a first launch returns nothing
            with self.lock:
                self._write_trace(
                    {
                        "kind": "step",
                        "end": self.clock(),
                        "period": period,
                        "frames": len(outputs),
                        "host_cpu_s": host_cpu,
                        **dataclasses.asdict(timing),
                    }
                )

    def _on_frame(self, request: Request, codes: np.ndarray, reason: str | None) -> None:
        stream = self.streams.get(request.request_id)
        # A stream under this id may be a newer request's, submitted after the first one ended.
        if stream is None or stream.ended or stream.request is not request:
            return
        stream.frames.append(codes)
        if reason is not None and not stream.generated:  # (the engine sends one last frame; defensive)
            stream.generated = True
            self.draining += 1
        self.scheduler.frames_generated(request.request_id, 1, done=stream.generated)

    def _watch_cancellations(self) -> None:
        """End the streams whose client cancelled or went away; their generation stops at the next step.

        A check is a round trip to the server process that drops the GIL, and taking the GIL back
        beside a thread running Python waits about the switch interval (5 ms; benchmarks/bls_gil.py).
        So checks run under the service lock, where the threads that would compete for the GIL wait
        on the lock instead: a burst of plain round trips, not a GIL handoff per stream. The lock is
        let go once a hold has lasted MAX_HOLD_S, and then left alone long enough that the watcher
        holds it at most `cancellation_lock_share` of the time: a sweep makes one check per open
        stream, 0.08-0.25 ms each on the H200 hosts of session 23. A hold's time includes getting the
        GIL back after each check. Streams still generating or waiting for a row come first, as
        their cancellation frees a KV-cache row and a share of every frame step; draining ones
        (generated, audio still owed) after them.
        """
        pause_per_held_second = 1 / self.cancellation_lock_share - 1
        while not self._stopping.wait(self.cancellation_check_s):
            with self.lock:
                streams = sorted(self.streams.values(), key=lambda stream: stream.generated)  # (stable)
            position = 0
            while position < len(streams):
                with self.lock:
                    held_from = time.perf_counter()
                    checked, ended = 0, False
                    while position < len(streams) and (
                        not checked or time.perf_counter() - held_from < MAX_HOLD_S
                    ):
                        stream = streams[position]
                        position += 1
                        if not stream.ended:  # (ended since the sweep began)
                            checked += 1
                            ended |= self._end_if_cancelled(stream)
                    if ended:
                        self.incoming = [s for s in self.incoming if not s.ended]
                        self.lock.notify_all()
                    held = time.perf_counter() - held_from
                if self.metrics and checked:
                    self.metrics.cancellation_checks(checked, held)
                if self._stopping.wait(held * pause_per_held_second):
                    return

    def _end_if_cancelled(self, stream) -> bool:
        """End the stream if its client is gone (under the service lock); whether it was."""
        try:
            gone = stream.sink.cancelled()
        except Exception:  # the request is unreachable: treat the client as gone
            log.warning(
                "stream %s: cancellation check failed: %s",
                stream.request.request_id,
                traceback.format_exc(limit=1),
            )
            gone = True
        if gone:
            try:
                self._end(stream, "request cancelled")
            except Exception:  # keep watching the other streams
                log.error(
                    "stream %s: ending it failed: %s", stream.request.request_id, traceback.format_exc()
                )
        return gone

    def _fail_all_running(self, message: str) -> None:
        """After a failed step: end every stream the engine had taken, running, being admitted
        (those were in neither of its lists) or with frames in flight, with the error. Streams still
        in `incoming` wait for the next step; streams whose last frame had reached the service still
        get their remaining chunks. (A request the engine marked finished whose last frame was lost
        with the step is failed too: nothing else would end its stream.)"""
        with self.lock:
            for stream in list(self.streams.values()):
                if stream not in self.incoming and not stream.generated:
                    stream.request.cancelled = True
                    self._end(stream, message)
            self.engine.abort()

    def _end(self, stream: Stream, error: str | None) -> None:
        """Close a stream exactly once: with an error, or (error None) after its final chunk was sent.

        Its generation stops at the engine's next step (a no-op if it already finished).
        """
        if stream.ended:
            return
        stream.ended = True
        stream.request.cancelled = True
        self.streams.pop(stream.request.request_id, None)
        self.draining -= stream.generated
        self._free_slot(stream)
        self.scheduler.close(stream.request.request_id)
        self._publish_gauges()
        if error is not None:
            try:
                stream.sink.fail(error)
            except Exception:  # the client may be gone; nothing else to tell it
                log.debug("could not deliver error to %s", stream.request.request_id)

    def _free_slot(self, stream: Stream) -> None:
        """Return an ended stream's codec slot, unless a lane may still write it (then on return)."""
        if stream.ended and not stream.decoding and stream.codec_slot is not None:
            self.free_slots.append(stream.codec_slot)
            stream.codec_slot = None

    def _publish_gauges(self) -> None:
        if self.metrics:
            # After a step's admissions, the engine's waiting requests are those no row was free for
            # (the service's `incoming`, submitted during the step, join the batch at the next one).
            self.metrics.gauges(
                len(self.streams),
                len(self.engine.running),
                len(self.engine.waiting),
                self.draining,
                self.scheduler.queue_depths(),
                self.scheduler.deadline_misses,
            )

    # -- codec lanes -----------------------------------------------------------------------------

    def _lane_loop(self, lane: str) -> None:
        with self._own_stream():
            self._serve_lane(lane)

    def _serve_lane(self, lane: str) -> None:
        while self.running:
            with self.lock:
                batch = self.scheduler.next_batch(lane)
                while self.running and not batch:
                    self.lock.wait(0.5)
                    batch = self.scheduler.next_batch(lane)
            if batch:
                self._decode_batch(lane, batch)

    def _trace(self, chunk: Chunk, batch: int, started: float, decoded: float, sent: float) -> None:
        """One chunk's path, on the service clock (seconds): its request arrived, its frames were
        cut into a chunk (when they were generated, or when the stream's previous chunk was done,
        whichever was later), its codec call started and ended, and when it was due (playback
        deadline, or for a first chunk the TTFA target)."""
        self._write_trace(
            {
                "kind": "chunk",
                "stream": chunk.stream.stream_id,
                "index": chunk.index,
                "lane": chunk.lane,
                "promoted": chunk.promoted,
                "taken": chunk.taken,
                "frames": chunk.frames,
                "batch": batch,
                "arrived": chunk.stream.opened_at,
                "cut": chunk.ready_at,
                "start": started,
                "end": decoded,
                "due": chunk.due(self.scheduler.config.ttfa_target_s),
                "sent": sent,
            }
        )

    def _write_trace(self, record: dict) -> None:
        """One line of the trace: a chunk sent, or a frame step (its period, its frames, and its
        `StepTiming`). Under the service lock. A failed write (disk full, file closed) turns the
        trace off: it must never stop a lane or the engine."""
        try:
            self.chunk_trace.write(json.dumps(record) + "\n")
        except (OSError, ValueError) as error:
            log.error("chunk trace stopped: %s", error)
            self.chunk_trace = None

    def _drain_inline(self) -> None:
        while True:
            with self.lock:
                batch = self.scheduler.next_batch(INLINE)
            if not batch:
                return
            self._decode_batch(INLINE, batch)

    def _call_span(self, lane: str, issued: float) -> tuple[float, float]:
        """(start, end) of a codec call just returned. With several workers on a lane, a call issued
        while the lane's previous one ran waited for it in Triton's queue (one codec instance runs
        one call at a time): it starts when that one ended. Counting the wait would inflate the lane's
        decode estimate, and with it the slack the scheduler routes by. A worker that records its
        end late (descheduled after its call returned) can leave the wait counted: an approximation."""
        ended = self.clock()
        with self.lane_clock_lock:
            started = max(issued, self.lane_free_at.get(lane, issued))
            self.lane_free_at[lane] = max(ended, self.lane_free_at.get(lane, ended))
        return started, ended

    def _decode_batch(self, lane: str, batch: list[Chunk]) -> None:
        with self.lock:
            # Only chunks of streams still open: the scheduler's timeline must be the chunk's own.
            live = [
                (c, self.streams.get(c.stream.stream_id))
                for c in batch
                if self.scheduler.streams.get(c.stream.stream_id) is c.stream
            ]
            live = [(c, s) for c, s in live if s is not None and not s.ended]
            if not live:
                return
            codes = np.stack(
                [
                    padded_codes(s.frames[c.first_frame : c.first_frame + c.frames], c.decode_frames)
                    for c, s in live
                ]
            )
            for _, stream in live:
                stream.decoding = True
        issued = self.clock()
        try:
            audio = self.lanes[URGENT if lane == INLINE else lane].decode(
                torch.from_numpy(codes.astype(np.int32)),
                torch.tensor([c.first_frame for c, _ in live], dtype=torch.int64),
                torch.tensor([s.codec_slot for _, s in live], dtype=torch.int64),
            )
        except Exception as error:
            log.error("codec lane %s failed: %s", lane, error)
            with self.lock:
                for _, stream in live:
                    stream.decoding = False
                    self._end(stream, f"codec lane '{lane}' failed: {error}")
                    self._free_slot(stream)  # also when it had already ended (cancelled) meanwhile
                self.lock.notify_all()
            return
        started, ended = self._call_span(lane, issued)
        elapsed = ended - started
        if self.metrics:
            self.metrics.codec_call(lane, codes.shape[0] * codes.shape[1], elapsed)
        samples_per_frame = audio.shape[1] // codes.shape[1]
        with self.lock:
            deliveries = []
            for row, (chunk, stream) in enumerate(live):
                stream.decoding = False
                if stream.ended:
                    self._free_slot(stream)
                else:
                    deliveries.append((row, chunk, stream))
        # The sends go out without the service lock: one is an IPC round trip per chunk (on the H200,
        # 2.5 ms a call at p50 and 9.5 at p90 for the urgent lane, more for the background lane's
        # larger batches), and the engine and the other lanes wait for that lock. A stream has one
        # chunk in flight, so nothing else sends for it now; one that ends meanwhile (a cancellation)
        # has a closed sink, which drops the chunk.
        sent = []  # (chunk, stream, when it was sent, or None if the client is gone)
        for row, chunk, stream in deliveries:
            info = np.array([chunk.index, chunk.first_frame, chunk.frames, LANE_CODES[chunk.lane]], np.int64)
            try:
                stream.sink.send(
                    audio[row, : chunk.frames * samples_per_frame],
                    codes[row, : chunk.frames],
                    info,
                    chunk.last,
                )
                sent.append((chunk, stream, self.clock()))
            except Exception as error:  # client gone: stop generating for it
                log.info("stream %s: send failed (%s); cancelling", stream.request.request_id, error)
                sent.append((chunk, stream, None))
        with self.lock:
            for chunk, stream, sent_at in sent:
                if sent_at is None or stream.ended:
                    self._end(stream, None)  # a no-op for a stream ended while its chunk was sent
                    continue
                if self.metrics:
                    self.metrics.chunk_sent(
                        chunk.lane,
                        chunk.frames,
                        elapsed,
                        chunk.index == 0,
                        sent_at - stream.submitted_at,
                        chunk.promoted,
                    )
                if self.chunk_trace:
                    self._trace(chunk, len(live), started, ended, sent_at)
                self.scheduler.chunk_done(chunk, elapsed, sent_at)
                if chunk.last:
                    self._end(stream, None)
            self.lock.notify_all()
