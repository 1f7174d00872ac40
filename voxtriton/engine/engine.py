"""The generation loop: admit requests, run one frame step for every running request, retire.

Continuous batching: a request that arrives joins the running batch at the next step (its prompt
is prefilled in that step) and leaves it the step it finishes, so no request waits for another.
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
    codes: np.ndarray  # [num_code_groups] int64
    finish_reason: str | None  # set on the request's last frame


@dataclass
class StepTiming:
    """Where one frame step's wall time went. Next to each other they tell GPU contention (the
    device time grows) from host work (only the wall grows) and from admissions (prefill grows)."""

    admit_s: float = 0.0  # admitting requests: their prompts' prefill and row setup, waited for
    decode_s: float = 0.0  # the frame's decode, launch to codes on the host
    decode_device_s: float | None = None  # the same decode as the GPU timed it (CUDA events; None on CPU)


class Engine:
    def __init__(self, runner: ModelRunner, max_running: int):
        if max_running > runner.max_rows:
            raise ValueError(f"max_running={max_running} exceeds the runner's {runner.max_rows} rows")
        self.runner = runner
        self.max_running = max_running
        self.eos = runner.config.talker.codec_eos_id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # index == row
        self.last_timing = StepTiming()
        self._decode_events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                               if runner.device.type == "cuda" else None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        needed = request.position + request.params.max_frames
        if needed > self.runner.max_positions:
            raise ValueError(f"request needs {needed} positions, the cache holds {self.runner.max_positions}")
        if len(request.prompt.trailing_text_ids) > self.runner.max_text_tokens:
            raise ValueError(f"text has {len(request.prompt.trailing_text_ids)} tokens, limit {self.runner.max_text_tokens}")
        self.waiting.append(request)

    def _release(self, request: Request, reason: str) -> None:
        """Take a request out of the batch; the last row moves into its place."""
        request.status, request.finish_reason = Status.FINISHED, reason
        row, last = request.row, len(self.running) - 1
        if row != last:
            moved = self.running[last]
            self.runner.move_row(last, row, moved.position)
            self.running[row], moved.row = moved, row
        self.running.pop()
        request.row = None

    def _admit(self) -> bool:
        """Prefill waiting requests into free rows; True if any was admitted."""
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            request.status, request.finish_reason = Status.FINISHED, "cancelled"
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            admitted.append(self.waiting.popleft())
        if not admitted:
            return False
        first_row = len(self.running)
        self.runner.prefill(admitted, first_row)
        for offset, request in enumerate(admitted):
            request.status, request.row = Status.RUNNING, first_row + offset
        self.running.extend(admitted)
        return True

    def step(self) -> list[FrameOutput]:
        """Generate the next frame of every running request (admitting waiting ones first)."""
        for request in [r for r in self.running if r.cancelled]:
            self._release(request, "cancelled")
        started = time.perf_counter()
        if self.waiting and self._admit():
            self.runner.synchronize()  # so the prefill's time is counted as admission, not decode
        if not self.running:
            return []
        timing = self.last_timing = StepTiming(admit_s=time.perf_counter() - started)
        started = time.perf_counter()
        span = max(r.position for r in self.running) + 1
        events = self._decode_events
        if events:
            events[0].record()
        result = self.runner.decode(len(self.running), span)
        if events:
            events[1].record()
        result = result.to("cpu", copy=True).numpy()  # waits for the decode, so both events are done
        timing.decode_s = time.perf_counter() - started
        if events:
            timing.decode_device_s = events[0].elapsed_time(events[1]) / 1e3
        outputs = []
        for request in list(self.running):
            row = result[request.row]
            request.frames += 1
            reason = None
            if request.frames >= request.params.max_frames:
                reason = "max_frames"
            elif row[-1] == self.eos and not request.params.ignore_eos:
                reason = "eos"
            outputs.append(FrameOutput(request, row[:-1], reason))
        for output in outputs:
            if output.finish_reason:
                self._release(output.request, output.finish_reason)
        return outputs
