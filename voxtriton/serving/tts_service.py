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

import collections
import threading
import time
from typing import Callable, TextIO

import torch

from ..engine.engine import Engine
from ..engine.request import Request
from ..scheduler.policy import ChunkScheduler, SchedulerConfig
from .service.cancellation import MAX_HOLD_S, CancellationWatcher
from .service.engine_loop import EngineLoop
from .service.lanes import LANE_CODES, LaneWorkers, own_stream, padded_codes
from .service.protocols import CodecLane, ResponseSink, ServiceMetrics
from .service.streams import Stream, StreamRegistry, WarmupSink, codec_slots
from .service.trace import ChunkTrace
from .state_pool import PrimedStates

__all__ = [
    "LANE_CODES",
    "MAX_HOLD_S",
    "CodecLane",
    "ResponseSink",
    "ServiceMetrics",
    "Stream",
    "TTSService",
    "codec_slots",
    "padded_codes",
]


class TTSService(StreamRegistry, EngineLoop, LaneWorkers, CancellationWatcher, ChunkTrace):
    """The entry point: `submit(request, sink)`, `warm_up`, `shutdown`. Its parts (serving/service/)
    run on its threads and share its state under `lock`."""

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
        primed_states: PrimedStates | None = None,
    ):
        """lanes share one codec state pool of at least `codec_slots(...)` rows. `chunk_trace`, if
        given, gets one JSON line per chunk sent and per frame step (see `_write_trace`).
        `lane_workers`: codec calls each lane keeps in flight; the server passes
        `TTSSettings.lane_workers` (2), direct users get one unless they ask. `max_draining`: codec
        state rows added to the shared pool for streams that have finished generating and still owe
        audio (not a cap of its own: see `submit`). `cancellation_lock_share`: the largest share of
        time the cancellation watcher holds the service lock (`_watch_cancellations`); the server
        passes `TTSSettings.cancellation_lock_share` (0.1), direct users get no pacing unless they ask.
        `primed_states`: where registered in-context voices' primed codec states are kept (on the
        lanes' shared pool); None: every in-context stream primes with a codec call."""
        self.engine = engine
        self.scheduler = ChunkScheduler(scheduler_config, clock)
        self.lanes = lanes
        self.device = torch.device(device)
        # Entered by the engine thread: the backbone's SM partition on a GPU, else a stream of its own,
        # so nothing the lane workers queue waits behind a frame step.
        self.engine_context = engine_context or own_stream(self.device)
        self.max_queued = max_queued
        self.cancellation_check_s = cancellation_check_s
        if not 0 < cancellation_lock_share <= 1:
            raise ValueError(
                f"cancellation_lock_share must be above 0 and at most 1, got {cancellation_lock_share}"
            )
        self.cancellation_lock_share = cancellation_lock_share
        self.metrics = metrics
        self.primed_states = primed_states
        self.clock = clock
        self.chunk_trace = chunk_trace
        self.lock = threading.Condition()
        self.incoming: list[Stream] = []
        self.primings: collections.deque[Stream] = collections.deque()  # see LaneWorkers._prime_ahead
        self.streams: dict[str, Stream] = {}
        self.text_arrived: dict[str, Stream] = {}  # input streams with text the engine has yet to take
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
                self.incoming = [stream for stream in self.incoming if not stream.closed]
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
