"""Chunking and lane routing: which frames become a chunk, and which codec lane decodes it.

Plain Python, no tensors, one injectable clock, so every decision can be tested on a simulated
clock. The serving layer calls it under one lock from the engine thread and the lane workers.

Definitions (../shared/design.md):
- A stream's playback starts when its first chunk is sent; after A seconds of audio were sent the
  listener's buffer runs dry at deadline = first_sent + A + stall observed so far.
- slack = deadline - now - expected background decode time (its queue included). A chunk is
  urgent when it is its stream's first chunk or its slack is below `slack_margin_s`.
- A first chunk has no playback deadline yet; it is due `ttfa_target_s` after the service took its
  request (at its arrival, or once its reference voice was encoded or an input stream's first
  words arrived).
  Each lane decodes earliest deadline first, so first chunks and chunks about to stall compete on
  one clock.
- Chunk sizes are fixed by the schedule (first chunk small, then growing to a maximum), so where
  chunk boundaries fall never depends on timing: only which lane decodes a chunk does. With
  `catch_up`, a stream whose generation ran ahead skips to a later size of the schedule. With
  `text_wait_send`, a stream that waits for its text (input streaming) sends the frames it has once
  its listener needs them, in a smaller chunk than the schedule's next; with `text_start_frames`, a
  stream whose text is still arriving starts with a larger first chunk, its listener's buffer
  against the gaps between words.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable

from .policies import BACKGROUND, INLINE, URGENT, Policy, get_policy

__all__ = ["BACKGROUND", "INLINE", "URGENT", "Chunk", "ChunkScheduler", "SchedulerConfig", "StreamTimeline"]

# `single_frame_start_streams` on a GPU unless set: closed loops of up to 32 streams measured no
# stall on an H100, and at 16 open loops of 70-80 req/s passed as without it
# (benchmarks/results/first_chunk_h100.md); half of 32 leaves room for slower cards.
GPU_SINGLE_FRAME_START_STREAMS = 16
# `first_chunk_hold_s` on a GPU unless set: on an H100, one stream's first audio came about 2 ms
# sooner (TTFA p50 14.5 against 16.7 ms), with no stall and p99 no worse in closed loops of 8 and 16
# streams (benchmarks/results/first_chunk_h100.md); a first chunk's codec call there takes under 5 ms
# with the GPU to itself.
GPU_FIRST_CHUNK_HOLD_S = 0.02


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "voxserve"
    # Frames per chunk, in order; the last size repeats. See `chunk_frames` for why this ramp.
    chunk_schedule: str = "2,2,4,4,8,8,16,16,25"
    slack_margin_s: float = 0.3
    # Chunks per codec call. The urgent lane (every lane but voxserve's background one) keeps calls
    # small, as its chunks wait for them.
    max_batch: int = 16
    # voxserve's background lane: its chunks all have slack, so it takes larger calls, which decode
    # more audio per GPU second.
    background_max_batch: int = 64
    frame_seconds: float = 0.08  # audio per frame: 1920 samples at 24 kHz
    initial_decode_estimate_s: float = 0.05
    # When a first chunk is due, after its request arrived (the time-to-first-audio target).
    ttfa_target_s: float = 0.2
    # voxserve: when the urgent lane is idle and the background lane more than a call behind, the
    # urgent lane takes background chunks (most urgent first, one size) of up to this many frames; 0: never.
    idle_urgent_takes_frames: int = 0
    # voxserve: the background lane decodes the size with the most chunks waiting (earliest deadline
    # first within it) instead of its earliest-deadline chunk's size: fuller calls, as all have slack.
    background_fullest_size: bool = True
    # A chunk after the first may take the largest later size of the schedule that the frames already
    # generated fill: fewer, larger codec calls. Chunk boundaries then depend on timing, the audio not.
    catch_up: bool = False
    # Input streaming: a stream paused for its text whose slack fell below `slack_margin_s` sends its
    # generated frames now, as the largest schedule size they fill, instead of waiting for text to
    # fill the schedule's next size. Its audio then keeps up with text that arrives at the pace of
    # speech; without it, the ramp's larger chunks need text about 1.5x faster than speech. Chunk
    # boundaries then depend on timing, the audio not.
    text_wait_send: bool = True
    # Input streaming: a stream whose text is still arriving when its first chunk is cut starts at
    # the schedule's first size of at least this many frames (skipping the smaller ones). While text
    # paces generation, the first chunk's audio is all the listener has against the gaps between
    # words: with text barely faster than speech, a 2-frame start (160 ms) runs dry at the first
    # late word. A larger start delays the first audio by the time its text takes to arrive.
    text_start_frames: int = 4
    # While at most this many streams are open (its own included), a stream whose text is whole
    # starts with a 1-frame chunk, then the schedule from its first size: its first audio comes a
    # frame step sooner. Under load a 1-frame start leaves the next chunk half the time to arrive
    # (80 ms of audio against 160), so it is for light load on a device whose two frame steps and
    # codec call take well under 80 ms; 0: never; -1: `GPU_SINGLE_FRAME_START_STREAMS` on a GPU,
    # never on a CPU (`for_device`; until then, never).
    single_frame_start_streams: int = -1
    # Under light load (`light_load`), while a stream's first chunk waits for or is in its codec call,
    # the engine holds its next frame step until that call returns, at most this long after the
    # chunk was cut, and only while every stream already playing keeps more than `slack_margin_s` of
    # audio in hand. The first chunk's call then has the GPU to itself: beside a frame step it shares
    # the SMs with the backbone's kernels (the lanes run under MPS) and takes several times as long.
    # 0: never; -1: `GPU_FIRST_CHUNK_HOLD_S` on a GPU, never on a CPU (`for_device`; until then,
    # never).
    first_chunk_hold_s: float = -1.0

    def __post_init__(self):
        get_policy(self.policy)
        try:
            sizes = self.sizes
        except ValueError:  # not a number: nothing is cached, the error below names the setting
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise ValueError(
                f"chunk_schedule must be comma-separated frame counts >= 1, got {self.chunk_schedule!r}"
            )
        if self.max_batch < 1 or self.background_max_batch < 1 or self.slack_margin_s < 0:
            raise ValueError("max_batch >= 1, background_max_batch >= 1 and slack_margin_s >= 0 are required")
        if self.ttfa_target_s < 0:
            raise ValueError(f"scheduler_ttfa_target_s must be >= 0, got {self.ttfa_target_s}")
        if self.catch_up and any(later < earlier for earlier, later in zip(sizes, sizes[1:])):
            raise ValueError(
                f"scheduler_catch_up needs a chunk_schedule that never shrinks, got {self.chunk_schedule!r}"
            )
        if self.single_frame_start_streams < -1:
            raise ValueError(
                "scheduler_single_frame_start_streams must be >= 0, or -1 for the device's default, "
                f"got {self.single_frame_start_streams}"
            )
        if self.text_start_frames < 1:
            raise ValueError(f"scheduler_text_start_frames must be >= 1, got {self.text_start_frames}")
        if self.first_chunk_hold_s < 0 and self.first_chunk_hold_s != -1:
            raise ValueError(
                "scheduler_first_chunk_hold_s must be >= 0, or -1 for the device's default, "
                f"got {self.first_chunk_hold_s}"
            )
        if self.idle_urgent_takes_frames < 0:
            raise ValueError(
                f"scheduler_idle_urgent_takes_frames must be >= 0, got {self.idle_urgent_takes_frames}"
            )

    def for_device(self, device_type: str) -> SchedulerConfig:
        """The config with its device defaults settled: a 1-frame start on a GPU (an H100's two frame
        steps and codec call take about 17 ms of the first chunk's 80), none on a CPU (on 2 cores they
        took about 80 ms and second chunks came late); the hold for first chunks on a GPU, where the
        codec lanes share the SMs with the backbone, none on a CPU (not measured there)."""
        gpu = device_type == "cuda"
        settled = {}
        if self.single_frame_start_streams == -1:
            settled["single_frame_start_streams"] = GPU_SINGLE_FRAME_START_STREAMS if gpu else 0
        if self.first_chunk_hold_s == -1:
            settled["first_chunk_hold_s"] = GPU_FIRST_CHUNK_HOLD_S if gpu else 0.0
        return replace(self, **settled) if settled else self

    @property
    def rules(self) -> Policy:
        """The policy named by `policy`."""
        return get_policy(self.policy)

    @property
    def lanes(self) -> tuple[str, ...]:
        """The lanes this policy's chunks are decoded on (`route` sends them there)."""
        return self.rules.lanes

    def batch_limit(self, lane: str) -> int:
        """Chunks per codec call on `lane`."""
        return self.background_max_batch if lane == BACKGROUND else self.max_batch

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(item) for item in self.chunk_schedule.split(","))

    def chunk_frames(self, index: int) -> int:
        """Frames in a stream's chunk number `index` (the last chunk may be shorter).

        A small first chunk keeps TTFA low; later chunks grow so the codec runs in efficient calls.
        The ramp sets how far ahead of playback generation must run: chunk k is due when the audio
        of chunks 0..k-1 has played, and it needs all frames up to its end, so with sizes doubling
        (2, 4, 8, 16) a stream stalls once a frame step takes more than about half a frame of audio
        (40 ms). Repeating each size (the default) lets the step reach about 53 ms, at the price of
        more, smaller codec calls. The second chunk must arrive while the first plays.
        """
        return self.sizes[min(index, len(self.sizes) - 1)]

    def first_position(self, text_open: bool, start_frames: int | None = None) -> int:
        """The schedule position of a stream's first chunk: 0, or with its text still arriving the
        first of at least `start_frames` frames (the request's; None: `text_start_frames`), the
        largest size if none is."""
        if not text_open:
            return 0
        start_frames = self.text_start_frames if start_frames is None else start_frames
        fitting = (at for at, size in enumerate(self.sizes) if size >= start_frames)
        return next(fitting, self.sizes.index(max(self.sizes)))

    def catch_up_position(self, position: int, pending: int) -> int:
        """The schedule position of a stream's next chunk when `pending` generated frames wait to be
        chunked: the first position from `position` on of the largest size they fill. The first of
        repeated sizes, so a chunk that only fills its own size does not skip the repeat, which lets
        a slow frame step keep up (`chunk_frames`)."""
        best = position
        for later in range(position + 1, len(self.sizes)):
            if self.sizes[later] > pending:
                break
            if self.sizes[later] > self.sizes[best]:
                best = later
        return best


@dataclass(eq=False)
class Chunk:
    stream: "StreamTimeline"
    index: int
    first_frame: int
    frames: int
    last: bool
    ready_at: float
    # Frames the codec call decodes: the schedule's size, to which a shorter last chunk is padded so it
    # joins a batch of that size and its CUDA graph (the codec is causal: the real audio is unchanged).
    # A chunk sent while its stream waits for text is a schedule size itself, never padded.
    decode_frames: int
    lane: str = ""
    promoted: bool = False  # queued for the background lane, then moved to the urgent lane
    taken: bool = False  # queued for the background lane, then decoded by the idle urgent lane
    text_wait: bool = False  # cut while its stream waited for text, smaller than the schedule's size
    decoded: bool = False  # its codec call returned (a first chunk's hold ends there, before the send)

    def due(self, ttfa_target_s: float) -> float:
        """When the listener needs this chunk: its playback deadline, or for a first chunk the TTFA
        target after the service took the request.

        A first chunk's due time must be in the future like every other chunk's. Were it the moment
        it became ready (in the past), a lane that keeps receiving first chunks would serve a
        stream's next chunk only once its deadline had passed, and so always late. Hence from when
        the service took the request, not from its arrival: a reference recording's encoding, or an
        input stream's wait for its first words, may take longer than the target.
        """
        deadline = self.stream.deadline()
        if deadline is not None:
            return deadline
        stream = self.stream
        return (stream.opened_at if stream.submitted_at is None else stream.submitted_at) + ttfa_target_s


@dataclass(eq=False)
class StreamTimeline:
    stream_id: str
    opened_at: float  # when the request arrived (an input stream's first piece): TTFA counts from here
    # When the service took it: once its reference voice was encoded, or an input stream's first words
    # arrived; its arrival if None. A first chunk is due from here (`Chunk.due`).
    submitted_at: float | None = None
    frames_generated: int = 0
    frames_chunked: int = 0
    chunks: int = 0
    schedule_position: int = 0  # of the next chunk's size; ahead of `chunks` once it caught up
    generation_done: bool = False
    in_flight: Chunk | None = None
    first_sent_at: float | None = None
    audio_sent_s: float = 0.0
    stall_s: float = 0.0
    closed: bool = False
    lane: str | None = None  # every chunk goes to this lane, whatever its slack (the server's warm-up)
    text_open: bool = False  # input streaming: its text is still arriving (see `text_start_frames`)
    text_start_frames: int | None = None  # its request's start, if it asked (else the configured one)

    def deadline(self) -> float | None:
        if self.first_sent_at is None:
            return None
        return self.first_sent_at + self.audio_sent_s + self.stall_s


@dataclass
class LaneEstimate:
    """Exponential moving average of one lane's decode latency per chunk."""

    seconds: float
    weight: float = 0.2

    def observe(self, seconds: float) -> None:
        self.seconds += self.weight * (seconds - self.seconds)


@dataclass
class ChunkScheduler:
    config: SchedulerConfig
    clock: Callable[[], float] = time.monotonic
    streams: dict[str, StreamTimeline] = field(default_factory=dict)
    queues: dict[str, list[Chunk]] = field(default_factory=lambda: {URGENT: [], BACKGROUND: [], INLINE: []})
    estimates: dict[str, LaneEstimate] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=lambda: {URGENT: 0, BACKGROUND: 0, INLINE: 0})
    deadline_misses: int = 0
    text_waiting: set[str] = field(default_factory=set)  # ids of the streams waiting for text

    def __post_init__(self):
        for lane in (URGENT, BACKGROUND, INLINE):
            self.estimates[lane] = LaneEstimate(self.config.initial_decode_estimate_s)

    # -- streams ---------------------------------------------------------------------------------

    def open(
        self, stream_id: str, arrived_at: float | None = None, lane: str | None = None
    ) -> StreamTimeline:
        """Start a stream's timeline; `arrived_at` (default now) is when its request arrived; `lane`
        pins all its chunks to one lane."""
        arrived_at = self.clock() if arrived_at is None else arrived_at
        return self.add(StreamTimeline(stream_id, arrived_at, lane=lane))

    def add(self, stream: StreamTimeline) -> StreamTimeline:
        """Schedule a timeline made elsewhere (the service's streams extend it)."""
        self.streams[stream.stream_id] = stream
        return stream

    def _starts_with_one_frame(self, stream: StreamTimeline) -> bool:
        """`single_frame_start_streams`: the server is lightly loaded and the stream's text whole (an
        input stream's start is its buffer against the gaps between words). Not for a stream pinned
        to a lane (the warm-up's), which runs the lane's shapes of the schedule."""
        return self.light_load() and not stream.text_open and stream.lane is None

    def light_load(self) -> bool:
        """At most `single_frame_start_streams` streams open (generating, or still sending audio)."""
        return len(self.streams) <= self.config.single_frame_start_streams

    def holds_for_first_chunks(self) -> bool:
        """Whether the engine may hold its steps for first chunks now (`first_chunk_hold_left`): the
        setting, light load, and a codec that shares the backbone's GPU and has a thread of its own."""
        rules = self.config.rules
        return (
            self.config.first_chunk_hold_s > 0
            and not rules.inline_decode
            and not rules.codec_on_second_gpu
            and self.light_load()
        )

    def first_chunk_hold_left(self, now: float | None = None) -> float:
        """Seconds the engine still holds its next frame step for first chunks (`first_chunk_hold_s`;
        0: none). Under light load, while a stream's first chunk is cut and its codec call has not
        returned, until `first_chunk_hold_s` after its cut, and never past the moment a playing
        stream that still generates would be left with `slack_margin_s` of audio in hand. None while
        another stream has no first chunk cut yet (it waits for frames, text or a KV row): holding
        the backbone would trade its first audio for this one's. Not where the engine thread decodes
        the chunks itself (`inline_decode`), nor where the codec has a GPU of its own
        (`codec_on_second_gpu`): there the call does not share the backbone's SMs."""
        if not self.holds_for_first_chunks():
            return 0.0
        hold = self.config.first_chunk_hold_s
        now = self.clock() if now is None else now
        left, margin = 0.0, float("inf")
        for stream in self.streams.values():
            chunk = stream.in_flight
            if stream.first_sent_at is None:
                if chunk is None:
                    return 0.0
                if not chunk.decoded:
                    left = max(left, chunk.ready_at + hold - now)
            elif not stream.generation_done:
                margin = min(margin, stream.deadline() - now - self.config.slack_margin_s)
        return max(0.0, min(left, margin))

    def close(self, stream_id: str) -> None:
        """Forget a stream (finished, cancelled or failed); its queued chunks are dropped."""
        stream = self.streams.pop(stream_id, None)
        self.text_waiting.discard(stream_id)
        if stream is not None:
            stream.closed = True
            for queue in self.queues.values():
                queue[:] = [c for c in queue if c.stream is not stream]

    def frames_generated(self, stream_id: str, count: int = 1, done: bool = False) -> list[Chunk]:
        stream = self.streams[stream_id]
        stream.frames_generated += count
        stream.generation_done = stream.generation_done or done
        return self._advance(stream)

    def _advance(self, stream: StreamTimeline) -> list[Chunk]:
        """Cut the stream's next chunk if it is due and none is in flight; queue it on its lane."""
        if stream.in_flight is not None or stream.closed:
            return []
        pending = stream.frames_generated - stream.frames_chunked
        position = stream.schedule_position
        if stream.chunks == 0:
            position = self.config.first_position(stream.text_open, stream.text_start_frames)
        elif self.config.catch_up:
            position = self.config.catch_up_position(position, pending)
        wanted = self.config.chunk_frames(position)
        text_wait = False
        if stream.chunks == 0 and pending == 1 and wanted > 1 and self._starts_with_one_frame(stream):
            size, decode_frames = 1, 1  # the schedule follows from its first size
        elif pending >= wanted or (stream.generation_done and pending > 0):
            size, decode_frames, position = min(pending, wanted), wanted, position + 1
        elif size := self._text_wait_size(stream, pending):
            decode_frames, text_wait = size, True  # the schedule's size stays the next one
        else:
            return []
        last = stream.generation_done and size == pending
        chunk = Chunk(stream, stream.chunks, stream.frames_chunked, size, last, self.clock(), decode_frames)
        chunk.text_wait = text_wait
        stream.chunks += 1
        stream.schedule_position = position
        stream.frames_chunked += size
        stream.in_flight = chunk
        chunk.lane = self.route(chunk)
        self.routed[chunk.lane] += 1
        self.queues[chunk.lane].append(chunk)
        return [chunk]

    # -- input streaming ---------------------------------------------------------------------------

    def set_text_waits(self, stream_ids: set[str]) -> None:
        """The streams now paused for their text (every other stream is not); cut the chunks that
        those whose listeners need audio soon can send (`text_wait_send`)."""
        self.text_waiting = {stream_id for stream_id in stream_ids if stream_id in self.streams}
        self.send_for_text_waits()

    def send_for_text_waits(self) -> bool:
        """Cut the chunks that streams waiting for text send now (see `text_wait_send`); whether
        there were any."""
        cut = False
        for stream in map(self.streams.get, self.text_waiting):
            cut = stream is not None and bool(self._advance(stream)) or cut
        return cut

    def next_text_wait_send(self) -> float | None:
        """When the next stream waiting for text will send its frames (None: none will, unless
        something else changes), so a caller with nothing else to do can sleep until then."""
        if not self.config.text_wait_send:
            return None
        times = [
            self._text_wait_send_at(stream)
            for stream in map(self.streams.get, self.text_waiting)
            if stream is not None
            and stream.in_flight is None
            and stream.first_sent_at is not None
            and stream.frames_generated - stream.frames_chunked >= min(self.config.sizes)
        ]
        return min(times, default=None)

    def _text_wait_send_at(self, stream: StreamTimeline) -> float:
        """When the stream's slack falls below the margin (as `slack` counts it)."""
        return stream.deadline() - self.expected_background_s() - self.config.slack_margin_s

    def _text_wait_size(self, stream: StreamTimeline, pending: int) -> int:
        """Frames a stream waiting for text sends now: the largest schedule size its `pending`
        frames fill once its slack is below the margin (a captured codec shape), else 0. Not before
        its first chunk, whose size sets how much audio the listener starts with."""
        waiting = stream.stream_id in self.text_waiting
        if not (self.config.text_wait_send and waiting) or stream.first_sent_at is None:
            return 0
        if self.clock() < self._text_wait_send_at(stream):
            return 0
        return max((size for size in self.config.sizes if size <= pending), default=0)

    # -- routing ---------------------------------------------------------------------------------

    def expected_background_s(self) -> float:
        """Decode time of a chunk sent to the background lane now: the batches queued ahead of it, its
        own call, and the call the lane may be in the middle of (counted whole: under load the lane
        is busy, and a chunk that waits for a call it did not foresee is a stall)."""
        batches_ahead = len(self.queues[BACKGROUND]) // self.config.batch_limit(BACKGROUND)
        return self.estimates[BACKGROUND].seconds * (2 + batches_ahead)

    def slack(self, chunk: Chunk, now: float | None = None) -> float | None:
        deadline = chunk.stream.deadline()
        if deadline is None:
            return None
        now = self.clock() if now is None else now
        return deadline - now - self.expected_background_s()

    def route(self, chunk: Chunk) -> str:
        if chunk.stream.lane is not None:
            return chunk.stream.lane
        if not self.config.rules.routes_by_slack:
            return self.config.lanes[0]
        slack = self.slack(chunk)
        return URGENT if slack is None or slack < self.config.slack_margin_s else BACKGROUND

    # -- lanes -------------------------------------------------------------------------------------

    def _promote(self, now: float) -> None:
        """Background chunks whose slack fell below the margin while queued move to the urgent lane."""
        if not self.config.rules.routes_by_slack:
            return
        waiting = self.queues[BACKGROUND]
        late = [
            c
            for c in waiting
            if c.stream.lane is None
            and (s := self.slack(c, now)) is not None
            and s < self.config.slack_margin_s
        ]
        for chunk in late:
            waiting.remove(chunk)
            chunk.lane, chunk.promoted = URGENT, True
            self.queues[URGENT].append(chunk)

    def next_batch(self, lane: str) -> list[Chunk]:
        """Chunks for one decode call on `lane`: the most urgent chunk plus others of its size.

        Equal sizes (`decode_frames`) keep a batch one shape. Within a lane the order is
        earliest deadline first (first come first served for `concurrent`), so no chunk waits
        behind an unbounded stream of later ones; background chunks that run out of slack are
        promoted to the urgent lane instead of waiting for the slow one, and an idle urgent lane may
        take a few more (`idle_urgent_takes_frames`). With `background_fullest_size`, the background
        lane takes the size with the most chunks waiting instead of its head's.
        """
        now = self.clock()
        self._promote(now)
        queue = self.queues[lane]
        if not queue:
            return self._take_for_idle_urgent_lane() if lane == URGENT else []
        target = self.config.ttfa_target_s
        queue.sort(
            key=(lambda c: c.due(target)) if self.config.rules.deadline_order else (lambda c: c.ready_at)
        )
        limit = self.config.batch_limit(lane)
        if lane == BACKGROUND and self.config.background_fullest_size:
            sizes = collections.Counter(c.decode_frames for c in queue)
            fullest = max(sizes, key=lambda size: min(sizes[size], limit))  # ties: the earliest due
            queue.sort(key=lambda c: c.decode_frames != fullest)  # stable: deadline order within each part
        return self._take_head_size(queue, limit)

    @staticmethod
    def _take_head_size(queue: list[Chunk], limit: int) -> list[Chunk]:
        """Up to `limit` chunks of the (sorted) queue's head size, in queue order, taken off it."""
        size = queue[0].decode_frames
        batch = [c for c in queue if c.decode_frames == size][:limit]
        for chunk in batch:
            queue.remove(chunk)
        return batch

    def _take_for_idle_urgent_lane(self) -> list[Chunk]:
        """Background chunks for the urgent lane while it has nothing of its own (voxserve, when
        `idle_urgent_takes_frames` allows): the most urgent ones, of one size, up to that many frames.

        Only from a backlog of more than one background call (`background_max_batch` chunks): an idle
        background lane takes its chunks itself, in full batches (both lanes' workers wake on the
        same events, and whichever comes first would otherwise split them up)."""
        waiting = self.queues[BACKGROUND]
        budget = self.config.idle_urgent_takes_frames
        if (
            not self.config.rules.routes_by_slack
            or not budget
            or len(waiting) <= self.config.batch_limit(BACKGROUND)
            or any(c.stream.lane is not None for c in waiting)  # pinned chunks stay on their lane
        ):
            return []
        waiting.sort(key=lambda c: c.due(self.config.ttfa_target_s))
        count = min(self.config.batch_limit(URGENT), budget // waiting[0].decode_frames)
        if count == 0:
            return []
        batch = self._take_head_size(waiting, count)
        for chunk in batch:
            chunk.lane, chunk.taken = URGENT, True
        return batch

    def chunk_done(self, chunk: Chunk, decode_seconds: float, sent_at: float | None = None) -> list[Chunk]:
        """The chunk's audio was sent (at `sent_at`, default now): advance the playback clock and cut
        the stream's next chunk."""
        now = self.clock() if sent_at is None else sent_at
        stream = chunk.stream
        self.estimates[chunk.lane].observe(decode_seconds)
        if stream.first_sent_at is None:
            stream.first_sent_at = now
        else:
            late = now - stream.deadline()
            if late > 0:  # the listener's buffer ran dry before this chunk arrived
                stream.stall_s += late
                self.deadline_misses += 1
        stream.audio_sent_s += chunk.frames * self.config.frame_seconds
        stream.in_flight = None
        if chunk.last or stream.closed:
            return []
        return self._advance(stream)

    def queue_depths(self) -> dict[str, int]:
        return {lane: len(queue) for lane, queue in self.queues.items()}
