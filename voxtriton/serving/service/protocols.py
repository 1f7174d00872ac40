"""What the service calls: codec lanes, response sinks and metrics (Triton's, or a test's)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ...engine.engine import StepTiming


class CodecLane(Protocol):
    def decode(
        self, codes: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, prime: bool = False
    ) -> torch.Tensor:
        """codes [B, T, Q] int32, start [B] int64, slots [B] int64 (rows of the codec state pool)
        -> audio [B, N] fp32 on the CPU. `prime`: the rows' states advance over the codes and no
        audio is made (N = 0)."""


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


class ServiceMetrics(Protocol):
    def chunk_sent(
        self,
        lane: str,
        frames: int,
        decode_s: float,
        first: bool,
        since_submit_s: float,
        promoted: bool = False,
        since_text_end_s: float | None = None,
        since_text_s: float | None = None,
        text_wait: bool = False,
    ) -> None:
        """A chunk's audio was sent; `promoted`: it waited for the background lane until its slack ran
        out and was decoded on the urgent lane instead; `text_wait`: its stream, waiting for text,
        sent it smaller than the schedule's next size. `since_submit_s` counts from an input stream's
        first text piece; `since_text_end_s`, on an input stream's last chunk, from its last piece;
        `since_text_s`, on an input stream's first chunk, from the arrival of the latest text the
        engine had taken when the chunk's last frame came out (within a frame step): how long its
        first audio took once the text it waited for was there."""

    def codec_call(self, lane: str, frames: int, seconds: float) -> None:
        """One decode call on `lane`, of `frames` frames in all (padding included)."""

    def codec_primed(self, lane: str, reused: bool) -> None:
        """A stream's codec state was primed with its in-context voice's reference codes: decoded on
        `lane`, or (`reused`) copied from the state kept for its registered voice."""

    def rejected(self) -> None: ...
    def cancellation_checks(self, streams: int, seconds: float) -> None:
        """The cancellation watcher checked `streams` streams in one hold of the service lock,
        held `seconds`: the engine and the lanes wait that long for it."""

    def frame_step(self, seconds: float, batch: int, timing: StepTiming, host_cpu_s: float) -> None:
        """One pass of the engine loop that generated a frame for `batch` streams: `seconds` is the
        pass's whole wall time (the frame period while busy), `timing` splits out admission and decode,
        `host_cpu_s` is the engine thread's CPU time in the pass outside the decode."""

    def first_chunk_hold(self, seconds: float) -> None:
        """The engine held a frame step `seconds` for first chunks' codec calls
        (`scheduler_first_chunk_hold_s`)."""

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
