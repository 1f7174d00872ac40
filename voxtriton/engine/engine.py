"""The generation loop: admit requests, run one frame step for every running request, retire.

Continuous batching: a request that arrives joins the running batch at the next step (its prompt
is prefilled in that step) and leaves it the step it finishes, so no request waits for another.

Overlap: with `overlap` on, a step launches the next frame step on the GPU before it waits for the
frames of the step launched before it, so the GPU works through the host's bookkeeping and
admissions instead of waiting for them. Each frame step's inputs live on the GPU, so launching it
needs nothing from the previous step's frames, except knowing who finished: a request that ends by
end-of-speech is seen one step late, and that step's frame for it is dropped. Ends by `max_frames`
are known at launch, so those rows leave without a wasted frame.

Input streaming: a request whose text is still arriving (`text_open`) feeds one text id per frame
like the interleaved layout, and when it has used every id it knows, it pauses instead of feeding
padding: it keeps its row, but its frame step is masked (its state stays as it was) and no frame
comes back. It starts, and resumes from a pause, once `text_lookahead` ids wait ahead of it (or its
text ended), so its codes are those of the same text sent whole, whatever the pieces' timing.

First frames early: with overlap, `first_frame_rows` set, at most that many rows running and the
caller saying the load is light (`step(first_frames_early=...)`: its scheduler counts the streams
still sending audio too), a step that holds the first frame of a request whose text is whole (a
family with `early_first_frames`) returns that frame as soon as the step has completed it, before
the backbone advances, instead of with the next step's call: a stream that starts with a 1-frame
chunk no longer waits for the talker's part of the step. The host then waits for that part of the
step it launched before it returns the frames of the step before (a few ms later for the other
streams, once per new stream), so the bound keeps it to light load. (Without overlap a step's
frames come back with it anyway.) With `step(defer_advance=True)` the step's second part waits for
the next call, which launches it before anything else: the caller decodes the first chunk meanwhile
without the backbone's kernels beside it (only in a step of first frames alone).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np
import torch

from .model_runner import ModelRunner
from .request import Request, Status


@dataclass
class FrameOutput:
    request: Request
    codes: np.ndarray | None  # [num_code_groups] int64; None: it ended before any frame (eos)
    finish_reason: str | None  # set on the request's last frame


@dataclass
class StepTiming:
    """Where one step's wall time went, on the host, and what the GPU spent on it.

    Next to each other they tell GPU contention (the device times grow) from host work (only the wall
    grows) and from admissions. With overlap, `admitted` and `batch` describe the step this call
    launched, the device times the step whose frames it returned."""

    admit_s: float = 0.0  # admitting requests: prompts' uploads and the prefill's launch (its run, on CPU)
    decode_s: float = 0.0  # launching the frame step and waiting for the frames returned
    decode_cpu_s: float = 0.0  # the engine thread's CPU time in decode_s (waiting for a GPU event can spin)
    # The returned frames' step as timed on the GPU (CUDA events; None on CPU).
    decode_device_s: float | None = None
    # The prefill launched with that step, on the GPU (None: none, or CPU).
    prefill_device_s: float | None = None
    admitted: int = 0  # requests admitted by this step
    batch: int = 0  # rows in the frame step this step launched


@dataclass
class _Launched:
    """A frame step on its way: `requests[i]` owned row i when it was launched."""

    requests: list[Request | None]  # None: the row was paused
    # CUDA timing events (None on a CPU): before the prefill (None: none), then a start and an end
    # around each part of the frame step launched on its own (one part, or two with a deferred advance).
    events: list | None
    codes: torch.Tensor | None = None  # [len(requests), groups + 1] (`ModelRunner.stash_codes`), once queued
    ready: torch.cuda.Event | None = None
    # First frames to return before the step ends: (their copy, its event, their rows); None: none.
    first_frames: tuple[torch.Tensor, torch.cuda.Event | None, list[int]] | None = None
    returned: frozenset[int] = frozenset()  # rows whose frame was returned early


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        max_running: int,
        overlap: bool = False,
        text_lookahead: int = 1,
        first_frame_rows: int = 0,
    ):
        """first_frame_rows: return first frames early while at most this many rows run (see the
        module's docstring; 0: never, and without overlap or `early_first_frames`)."""
        if max_running > runner.max_rows:
            raise ValueError(f"max_running={max_running} exceeds the runner's {runner.max_rows} rows")
        if text_lookahead < 1:
            raise ValueError(f"text_lookahead must be at least 1, got {text_lookahead}")
        self.runner = runner
        self.text_lookahead = text_lookahead
        self.first_frame_rows = first_frame_rows if runner.early_first_frames and overlap else 0
        self.holds: list[bool] = []  # per running row, what the runner was last told (`set_holds`)
        # Running requests whose text may still change their row: text still arriving, or paused.
        self.streaming: set[Request] = set()
        self.max_running = max_running
        self.overlap = overlap
        self.end_marker, self.empty_end_marker = runner.end_marker, runner.empty_end_marker
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # index == row; requests whose next frame is still to launch
        self.in_flight: _Launched | None = None
        self.deferred: _Launched | None = None  # a step whose backbone part waits (`step(defer_advance=...)`)
        self.last_timing = StepTiming()
        self._cuda = runner.device.type == "cuda"

    @property
    def has_work(self) -> bool:
        """A step would do something: admit (a row is free), generate, return frames in flight, or
        drop a cancelled request. Rows all held by streams paused for text admit nothing: the engine
        thread waits instead of stepping for nothing until text comes."""
        free = len(self.running) < self.max_running
        return bool(
            self.in_flight
            or any((free and self._may_start(r)) or r.cancelled for r in self.waiting)
            or any(self._may_generate(r) or r.cancelled for r in self.running)
        )

    def waiting_for_text(self) -> list[Request]:
        """Running requests that generate nothing until more of their text arrives, every frame they
        generated returned (none in a step in flight)."""
        return [r for r in self.streaming if not self._may_generate(r) and r.emitted == r.frames]

    def add(self, request: Request) -> None:
        needed = request.position + request.params.max_frames
        if needed > self.runner.max_positions:
            raise ValueError(f"request needs {needed} positions, the cache holds {self.runner.max_positions}")
        self._check_text_length(request)
        self.waiting.append(request)

    def add_text(self, request: Request, ids: list[int], end: bool) -> None:
        """More text of an input-streaming request (between steps); `end`: its text is complete."""
        if not request.text_open:
            raise ValueError(f"request {request.request_id} takes no more text")
        request.text.extend(ids)
        if end:
            request.text.append(self.runner.config.tts_eos_token_id)
            request.text_open = False
        self._check_text_length(request)

    def _check_text_length(self, request: Request) -> None:
        if len(request.text) > self.runner.max_text_tokens:
            raise ValueError(
                f"text: too long: {len(request.text)} tokens (limit {self.runner.max_text_tokens})"
            )

    def _may_start(self, request: Request) -> bool:
        return not request.text_open or len(request.text) >= self.text_lookahead

    def _may_generate(self, request: Request) -> bool:
        """Whether a running request's next frame can launch: its text id is known (after a pause,
        `text_lookahead` of them), or its text has ended (then padding follows tts_eos)."""
        if not request.text_open:
            return True
        ahead = len(request.text) - request.frames
        return ahead >= (self.text_lookahead if request.paused else 1)

    def abort(self) -> None:
        """Forget every request, running, waiting or in flight (after a failed step)."""
        self.running.clear()
        self.waiting.clear()
        self.holds.clear()
        self.streaming.clear()
        self.in_flight = self.deferred = None
        self.runner.advance_pending = None

    def _leave_batch(self, request: Request) -> None:
        """Free a request's row; the last row moves into its place (queued after the steps in flight)."""
        self._advance_deferred()
        row, last = request.row, len(self.running) - 1
        if row != last:
            moved = self.running[last]
            self.runner.move_row(last, row, moved.position)
            self.running[row], moved.row = moved, row
            self.holds[row] = self.holds[last]  # the move copied the row's hold flag too
        self.running.pop()
        self.holds.pop()
        self.streaming.discard(request)
        request.row = None

    @staticmethod
    def _finish(request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason

    def _admit(self) -> int:
        """Prefill waiting requests into free rows; returns how many were admitted."""
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, "cancelled")
        admitted, short_of_text = [], []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            request = self.waiting.popleft()
            (admitted if self._may_start(request) else short_of_text).append(request)
        self.waiting.extendleft(reversed(short_of_text))  # they keep their places
        if admitted:
            first_row = len(self.running)
            self.runner.prefill(admitted, first_row)
            for offset, request in enumerate(admitted):
                request.status, request.row = Status.RUNNING, first_row + offset
                request.text_written = len(request.text)
                if request.text_open:
                    self.streaming.add(request)
            self.running.extend(admitted)
            self.holds.extend([False] * len(admitted))
        return len(admitted)

    def _sync_text(self) -> list[bool]:
        """Write running requests' new text ids into their rows, decide which rows pause, and tell the
        runner what changed; returns the pauses by row."""
        rows, columns, ids, changed = [], [], [], False
        for request in list(self.streaming):
            written, known = request.text_written, len(request.text)
            rows += [request.row] * (known - written)
            columns += range(written, known)
            ids += request.text[written:]
            request.text_written = known
            request.paused = not self._may_generate(request)
            if self.holds[request.row] != request.paused:
                self.holds[request.row], changed = request.paused, True
            if not (request.text_open or request.paused):  # all its text is in its row
                self.streaming.discard(request)
        if ids:
            self.runner.write_text(rows, columns, ids)
        if changed:
            self.runner.set_holds(self.holds)
        return self.holds

    def step(self, first_frames_early: bool = True, defer_advance: bool = False) -> list[FrameOutput]:
        """Launch the next frame of every running request (admitting waiting ones first) and return
        the frames of the step launched before it, or, without overlap, of this one.
        `first_frames_early`: whether first frames may come early at all now; the caller whose
        scheduler starts streams with one frame only under light load says whether the load is light
        (it counts the streams still sending audio too, which have left the engine).
        `defer_advance`: a step whose every row returns its first frame early leaves its second part
        (the backbone advanced) to the next call, which launches it before anything else, so a first
        chunk's codec call that runs in between has the GPU to itself (the caller holds its next step
        for it). No other row's frame waits for it."""
        advance_started, advance_cpu_started = time.perf_counter(), time.thread_time()
        self._advance_deferred()  # counted in this step's decode time
        advance_s = time.perf_counter() - advance_started
        advance_cpu_s = time.thread_time() - advance_cpu_started
        for request in [r for r in self.running if r.cancelled]:
            self._leave_batch(request)
            self._finish(request, "cancelled")
        started = time.perf_counter()
        prefill_event = self._event() if self.waiting else None
        admitted = self._admit() if self.waiting else 0
        holds = self._sync_text()
        generating = holds.count(False)
        timing = StepTiming(admit_s=time.perf_counter() - started, admitted=admitted, batch=generating)
        started, cpu_started = time.perf_counter(), time.thread_time()
        launched = (
            self._launch(prefill_event if admitted else None, holds, first_frames_early, defer_advance)
            if generating
            else None
        )
        firsts = self._first_frames(launched) if launched is not None and launched.first_frames else []
        if self.overlap:
            launched, self.in_flight = self.in_flight, launched
        if launched is not None:
            codes = self.runner.read_codes(launched.codes, launched.ready)
        timing.decode_s = time.perf_counter() - started + advance_s
        timing.decode_cpu_s = time.thread_time() - cpu_started + advance_cpu_s
        if launched is None:
            self.last_timing = timing
            return firsts
        if launched.events:
            before_prefill, *parts = launched.events
            timing.decode_device_s = sum(a.elapsed_time(b) for a, b in zip(parts[::2], parts[1::2])) / 1e3
            if before_prefill is not None:
                timing.prefill_device_s = before_prefill.elapsed_time(parts[0]) / 1e3
        self.last_timing = timing
        return self._frames(launched, codes) + firsts

    def _event(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _launch(
        self,
        before_prefill: torch.cuda.Event | None,
        holds: list[bool],
        first_frames_early: bool,
        defer_advance: bool,
    ) -> _Launched:
        """Queue one frame step for rows 0..B-1 (paused ones masked) and the copy of its codes to the
        host; with first frames early and `defer_advance`, perhaps only the step's first part (`step`)."""
        span = max(r.position for r in self.running) + 1
        if True in holds:
            requests = [None if held else request for request, held in zip(self.running, holds)]
        else:
            requests = list(self.running)
        first_rows = []
        if first_frames_early and 0 < len(self.running) <= self.first_frame_rows:
            # An input stream starts with several frames: its first one alone is no use early.
            first_rows = [
                row for row, r in enumerate(requests) if r is not None and r.frames == 0 and not r.text_open
            ]
        launched = _Launched(requests, [before_prefill, self._event()] if self._cuda else None)
        if first_rows:
            frames, frames_ready = self.runner.complete_first_frames(len(self.running), span)
            launched.first_frames = (frames, frames_ready, first_rows)
            if defer_advance and len(first_rows) == len(requests) - requests.count(None):
                self._record_part_event(launched)
                self.deferred = launched
            else:
                self._end_launch(launched, self.runner.advance(len(self.running)))
        else:
            self._end_launch(launched, self.runner.decode(len(self.running), span))
        generating = [request for request in requests if request is not None]
        for request in generating:  # all first: a row's move copies its positions up to this frame
            request.frames += 1
        for request in generating:
            if request.frames >= request.params.max_frames:  # its last frame is in this step
                self._leave_batch(request)
        return launched

    def _end_launch(self, launched: _Launched, codes: torch.Tensor) -> None:
        """After a step's last part: queue the copy of its codes for the host."""
        self._record_part_event(launched)
        launched.codes, launched.ready = self.runner.stash_codes(codes)

    def _advance_deferred(self) -> None:
        """Launch the deferred second part of a step (`step`'s `defer_advance`): before anything else
        is queued on the rows."""
        launched, self.deferred = self.deferred, None
        if launched is not None:
            self._record_part_event(launched)
            self._end_launch(launched, self.runner.advance(len(launched.requests)))

    def _record_part_event(self, launched: _Launched) -> None:
        if launched.events is not None:
            launched.events.append(self._event())

    def _first_frames(self, launched: _Launched) -> list[FrameOutput]:
        """The first frames of the step just launched, once its first part is done (the rest of the
        step runs on); the step's own return skips them (`_frames`)."""
        frames, ready, rows = launched.first_frames
        codes = self.runner.read_codes(frames, ready)
        outputs, returned = [], set()
        for row in rows:
            request = launched.requests[row]
            if request.cancelled:
                continue  # `_frames` finishes it with the step
            request.emitted += 1
            reason = "max_frames" if request.emitted >= request.params.max_frames else None
            outputs.append(FrameOutput(request, codes[row, :-1].copy(), reason))
            returned.add(row)
            if reason:  # its row was freed at launch
                self._finish(request, reason)
        launched.returned = frozenset(returned)
        return outputs

    def _frames(self, launched: _Launched, codes: np.ndarray) -> list[FrameOutput]:
        """The frames of a finished step, for the requests that have not ended since its launch."""
        outputs = []
        for row, request in enumerate(launched.requests):
            if request is None or request.status is Status.FINISHED or row in launched.returned:
                continue  # ended by end-of-speech in the step before, or cancelled: a frame past its end
            if request.cancelled:  # cancelled with its last frame in flight: nobody wants it
                self._finish(request, "cancelled")
                continue
            if self.empty_end_marker is not None and codes[row, -1] == self.empty_end_marker:
                frame, reason = None, "eos"  # its first frame was the end: it ends with no audio
            else:
                frame, reason = codes[row, :-1], None
                request.emitted += 1
                if request.emitted >= request.params.max_frames:
                    reason = "max_frames"
                elif codes[row, -1] == self.end_marker and not request.params.ignore_eos:
                    reason = "eos"
            outputs.append(FrameOutput(request, frame, reason))
            if reason:
                self._finish(request, reason)
                if request.row is not None:
                    self._leave_batch(request)
        return outputs
