"""Batched codec decode with CUDA graphs for the common chunk shapes.

A codec call decodes B chunks of T frames each (the scheduler batches equal sizes). On a GPU each
(batch bucket, T) shape is captured once as a CUDA graph over static input/output buffers, and a call
pads its batch up to the bucket; rows beyond the real batch decode silence from a fresh state and are
dropped. A length that was not captured (a chunk that caught up with its stream's frames) runs as
captured lengths in sequence, carrying the state, as a stream's chunks do: no eager launches, and no
cuDNN autotuning of a new shape while serving. Other shapes run eagerly, and so do
primings (`prime`): the state alone, with no audio.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..kernels import check_kernels


@functools.lru_cache(maxsize=1024)
def split_frames(frames: int, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
    """`frames` as the fewest `sizes` that add up to it (largest first), or None if none do."""
    fewest: list[tuple[int, ...] | None] = [()] + [None] * frames
    for total in range(1, frames + 1):
        for size in sizes:
            rest = fewest[total - size] if size <= total else None
            if rest is not None and (fewest[total] is None or len(rest) + 1 < len(fewest[total])):
                fewest[total] = rest + (size,)
    return tuple(sorted(fewest[frames], reverse=True)) if fewest[frames] is not None else None


def capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """Capture on the caller's stream when it is a side stream (an SM partition's), so replays stay there."""
    current = torch.cuda.current_stream(device)
    return None if current == torch.cuda.default_stream(device) else current


class CodecRunner:
    def __init__(
        self,
        model: nn.Module,
        batch_buckets: list[int] | None = None,
        frame_sizes: list[int] | None = None,
    ):
        """model: a family's codec decoder (`decode(codes, start, state)`, `new_state`, `config`; and
        `prime` for a family whose voices prime codec states). Captured: every (batch bucket, frame
        size)."""
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        check_kernels(self.device)  # decided now, before any graph capture
        self.quantizers = model.config.num_quantizers
        self.batch_buckets = sorted(set(batch_buckets or []))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None
        if self.device.type == "cuda" and self.batch_buckets and frame_sizes:
            shapes = {(batch, frames) for batch in self.batch_buckets for frames in frame_sizes}
            for batch, frames in sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True):
                self._capture(batch, frames)  # largest first: the shared pool is sized once

    def _static_inputs(self, batch: int, frames: int) -> dict:
        return {
            "codes": torch.zeros(batch, frames, self.quantizers, dtype=torch.long, device=self.device),
            "start": torch.zeros(batch, dtype=torch.long, device=self.device),
            "state": self.model.new_state(batch),
        }

    @torch.inference_mode()
    def _capture(self, batch: int, frames: int) -> None:
        inputs = self._static_inputs(batch, frames)
        for _ in range(2):
            self.model.decode(inputs["codes"], inputs["start"], inputs["state"])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device)):
            outputs = self.model.decode(inputs["codes"], inputs["start"], inputs["state"])
        self.pool = graph.pool()
        self.graphs[(batch, frames)] = (graph, inputs, outputs)

    @torch.inference_mode()
    def decode(
        self, codes: torch.Tensor, start: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """codes [B, T, Q], start [B], state [B, S] -> (audio [B, T*spf], next state [B, S]), model dtype."""
        batch, frames = codes.shape[0], codes.shape[1]
        bucket = next((b for b in self.batch_buckets if b >= batch), None)
        entry = self.graphs.get((bucket, frames)) if bucket else None
        if entry is None:
            pieces = self._captured_pieces(bucket, frames) if bucket else None
            if not pieces:
                return self.model.decode(codes.to(self.device), start.to(self.device), state.to(self.device))
            audio, offset = [], 0
            for size in pieces:
                piece, state = self.decode(codes[:, offset : offset + size], start + offset, state)
                audio.append(piece)
                offset += size
            return torch.cat(audio, dim=1), state
        graph, inputs, (audio, next_state) = entry
        inputs["codes"][:batch].copy_(codes)
        inputs["start"][:batch].copy_(start)
        inputs["state"][:batch].copy_(state)
        if bucket > batch:  # padding rows: a fresh stream decoding frame 0s
            inputs["codes"][batch:].zero_()
            inputs["start"][batch:].zero_()
            inputs["state"][batch:].zero_()
        graph.replay()
        # Copies: the static outputs are overwritten by the next replay, before callers are done.
        return audio[:batch].clone(), next_state[:batch].clone()

    @torch.inference_mode()
    def prime(self, codes: torch.Tensor, start: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q], start [B], state [B, S] -> the next state `decode` would give, without its
        audio (see the codec's `prime`). Eager: the length is a recording's, and the work is the
        transformer's launches over every frame at once and the convolutions' over a few frames.
        cuDNN does not autotune these shapes (a new length would wait for it); the codec's process
        makes one call at a time."""
        autotune, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
        try:
            return self.model.prime(codes.to(self.device), start.to(self.device), state.to(self.device))
        finally:
            torch.backends.cudnn.benchmark = autotune

    def _captured_pieces(self, bucket: int, frames: int) -> tuple[int, ...] | None:
        sizes = tuple(sorted(f for b, f in self.graphs if b == bucket))
        return split_frames(frames, sizes) if sizes else None
