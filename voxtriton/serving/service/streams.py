"""The stream registry: admission of requests, a stream's codec state row, and its end."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from ...engine.engine import Engine
from ...engine.request import Request
from ...errors import ServerBusy
from ...scheduler.policy import SchedulerConfig, StreamTimeline
from ..drain import SHUTTING_DOWN
from .protocols import ResponseSink

log = logging.getLogger(__name__)

QUEUED, RUNNING = "queued", "running"  # `Stream.priming`


@dataclass(eq=False, kw_only=True)
class Stream(StreamTimeline):
    """A stream as the service holds it: its scheduler timeline (`closed` once it ended, whatever the
    reason; `generation_done` once its last frame reached the service), its engine request, its sink
    and its codec state row."""

    request: Request
    sink: ResponseSink
    codec_slot: int | None  # row of the codec state pool, held until it ends and no chunk is in flight
    frames: list[np.ndarray] = field(default_factory=list)
    decoding: bool = False  # a chunk of this stream is in a codec lane
    # An in-context voice's codec priming ahead of its first chunk (`LaneWorkers._prime_ahead`):
    # QUEUED or RUNNING, then None; `primed_on` the lane whose codec primed its row.
    priming: str | None = None
    primed_on: str | None = None
    primed_at: float | None = None  # when its priming ahead ended (None: none ran ahead of its chunk)
    # Input streaming: text ids that arrived since the engine thread last took them, and whether the
    # text has ended (the engine thread hands both to the engine between steps).
    new_text: list[int] = field(default_factory=list)
    text_ended: bool = False
    text_ended_at: float | None = None  # when its last piece arrived
    text_at: float = 0.0  # when the latest text ids arrived (at submit: its first ids)
    text_handed_at: float = 0.0  # `text_at` of the latest ids handed to the engine
    first_chunk_text_at: float | None = None  # input streams: `text_handed_at` when its first chunk was cut
    input_stream: bool = False  # its text arrives in pieces (its request's `text_open` at submit)


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


def codec_slots(
    engine: Engine,
    max_queued: int,
    scheduler_config: SchedulerConfig,
    lane_workers: int = 1,
    max_draining: int = 0,
) -> int:
    """Rows the codec state pool needs: one per stream the service holds (generating, waiting for a
    row, or draining: generated, its audio still owed), plus the rows of streams that ended while a
    lane was decoding their chunk or priming their state (up to one batch per worker of each lane
    the policy uses; serial's one inline decode at a time; freed on return)."""
    workers = 1 if scheduler_config.rules.inline_decode else lane_workers
    in_flight = sum(scheduler_config.batch_limit(lane) for lane in scheduler_config.lanes)
    return engine.max_running + max_queued + max_draining + workers * in_flight


class StreamRegistry:
    """Part of `TTSService`: the streams it holds (`streams`, `incoming`) and their codec state rows,
    under the service lock."""

    def submit(
        self, request: Request, sink: ResponseSink, lane: str | None = None, opened_at: float | None = None
    ) -> None:
        """Queue a request; its chunks stream to `sink`. `lane` pins them to one lane (warm-up).
        `opened_at`: when it arrived, if before now (an input stream's first piece)."""
        with self.lock:
            if not self.running:  # shut down: nothing would ever end the stream
                raise ServerBusy(SHUTTING_DOWN)
            waiting = len(self.incoming) + len(self.engine.waiting)
            if request.request_id in self.streams:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            # A stream whose generation has ended holds only its codec state row until its last chunk
            # is sent: it no longer counts against max_streams + max_queued, only against the pool.
            generating_or_queued = len(self.streams) - self.draining
            busy = None
            if generating_or_queued >= self.engine.max_running + self.max_queued:
                busy = (
                    f"{generating_or_queued} streams generating or queued (max_streams "
                    f"{self.engine.max_running} + max_queued {self.max_queued}; {waiting} of them not "
                    "started yet)"
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
            stream = Stream(
                request.request_id,
                self.clock() if opened_at is None else opened_at,
                lane=lane,
                request=request,
                sink=sink,
                codec_slot=self.free_slots.pop(),
            )
            stream.text_at = stream.text_handed_at = stream.submitted_at = self.clock()
            stream.input_stream = stream.text_open = request.text_open
            stream.text_start_frames = request.start_frames
            self.streams[request.request_id] = stream
            self.incoming.append(stream)
            if request.prompt.reference_codes is not None and self._primes_ahead(lane):
                stream.priming = QUEUED
                self.primings.append(stream)
            self.lock.notify_all()

    def add_text(self, request_id: str, ids: list[int], end: bool) -> bool:
        """More text for an input-streaming request; False if its stream has ended."""
        with self.lock:
            stream = self.streams.get(request_id)
            if stream is None or stream.closed or stream.text_ended:
                return False
            stream.new_text += ids
            stream.text_ended = end
            now = self.clock()
            if ids or end:
                stream.text_at = now
            if end:
                stream.text_ended_at = now
            self.text_arrived[request_id] = stream
            self.lock.notify_all()
            return True

    def idle(self) -> bool:
        """No stream is queued, generating or owed audio."""
        with self.lock:
            return not self.streams

    def is_open(self, request_id: str) -> bool:
        """Whether a request's stream has not ended (finished, failed or cancelled)."""
        with self.lock:
            stream = self.streams.get(request_id)
            return stream is not None and not stream.closed

    def end_stream(self, request_id: str, error: str) -> None:
        """End a stream with an error (no-op if it has ended)."""
        with self.lock:
            stream = self.streams.get(request_id)
            if stream is not None:
                self._end(stream, error)
                self.lock.notify_all()

    def _end(self, stream: Stream, error: str | None) -> None:
        """Close a stream exactly once: with an error, or (error None) after its final chunk was sent.

        Its generation stops at the engine's next step (a no-op if it already finished).
        """
        if stream.closed:
            return
        stream.closed = True
        stream.request.cancelled = True
        self._unqueue_priming(stream)  # not started: it never will
        self.streams.pop(stream.request.request_id, None)
        self.draining -= stream.generation_done
        self._free_slot(stream)
        self.scheduler.close(stream.request.request_id)
        self._publish_gauges()
        if error is not None:
            try:
                stream.sink.fail(error)
            except Exception:  # the client may be gone; nothing else to tell it
                log.debug("could not deliver error to %s", stream.request.request_id)

    def _unqueue_priming(self, stream: Stream) -> None:
        """Take a priming that no lane worker has started out of the queue."""
        if stream.priming == QUEUED:
            self.primings.remove(stream)
            stream.priming = None

    def _free_slot(self, stream: Stream) -> None:
        """Return an ended stream's codec slot, unless a lane may still write it (then on return)."""
        if stream.closed and not stream.decoding and stream.priming is None and stream.codec_slot is not None:
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
