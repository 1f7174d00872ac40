"""Batched codec decode with CUDA graphs for the common chunk shapes.

A codec call decodes B chunks of T frames each (the scheduler batches equal sizes). On a GPU each
(batch bucket, T) shape is captured once as a CUDA graph over static input/output buffers, and a call
pads its batch up to the bucket; rows beyond the real batch decode silence from a fresh state and are
dropped. A length that was not captured (a chunk that caught up with its stream's frames) runs as
captured lengths in sequence, carrying the state, as a stream's chunks do: no eager launches, and no
cuDNN autotuning of a new shape while serving. Other shapes run eagerly.

A priming (`prime`: an in-context voice's reference codes, the state alone) runs the codec's first
half over the reference as captured lengths in sequence (`priming_sizes`, batch 1) and its second
half over the last frames once, as one more graph.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from ..kernels import check_kernels, plain_launches

# cuDNN's autotuning is one flag for the whole process: runners in one process (in-process lanes)
# turn it off for an eager priming one at a time.
_AUTOTUNE_LOCK = threading.Lock()


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
        priming_sizes: list[int] | None = None,
    ):
        """model: a family's codec decoder (`decode(codes, start, state)`, `new_state`, `config`; and
        `front`, `back`, `back_frames` and `prime` for a family whose voices prime codec states).
        Captured: every (batch bucket, frame size); with `priming_sizes`, the first half at batch 1
        for each of them and the second half over `back_frames`. Its kernels launch plainly
        (`plain_launches`), captured or eager."""
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
            # largest first: the shared pool is sized once
            for batch, frames in sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True):
                self.graphs[(batch, frames)] = self._capture(model.decode, self._static_inputs(batch, frames))
        self.front_graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.back_graph = None
        if self.device.type == "cuda" and priming_sizes:
            self._capture_priming(priming_sizes)

    def _capture_priming(self, sizes: list[int]) -> None:
        model = self.model
        for frames in sorted(set(sizes), reverse=True):
            self.front_graphs[frames] = self._capture(model.front, self._static_inputs(1, frames))
        hidden = torch.zeros(
            1, model.config.latent_dim, model.back_frames, device=self.device, dtype=self.dtype
        )
        inputs = {"hidden": hidden, "state": model.new_state(1)}
        self.back_graph = self._capture(lambda hidden, state: model.back(hidden, state, fresh=True), inputs)

    def _static_inputs(self, batch: int, frames: int) -> dict:
        return {
            "codes": torch.zeros(batch, frames, self.quantizers, dtype=torch.long, device=self.device),
            "start": torch.zeros(batch, dtype=torch.long, device=self.device),
            "state": self.model.new_state(batch),
        }

    @torch.inference_mode()
    def _capture(self, run, inputs: dict) -> tuple[torch.cuda.CUDAGraph, dict, tuple]:
        """`run` over the static `inputs` (its arguments, in order) as a graph: (graph, inputs, outputs)."""
        with plain_launches():
            for _ in range(2):
                run(*inputs.values())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device)):
                outputs = run(*inputs.values())
        self.pool = graph.pool()
        return graph, inputs, outputs

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
                with plain_launches():
                    return self.model.decode(*(t.to(self.device) for t in (codes, start, state)))
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
        audio (see the codec's `prime`): through the priming graphs, the first half in captured
        lengths carrying its state and the second half over the last `back_frames` frames. Without
        them (a CPU, a batch, a length no captured ones add up to, a reference no longer than
        `back_frames`) eagerly, with no cuDNN autotuning (each new length would wait for it)."""
        codes, start, state = codes.to(self.device), start.to(self.device), state.to(self.device)
        frames = codes.shape[1]
        pieces = split_frames(frames, tuple(self.front_graphs)) if codes.shape[0] == 1 else None
        if not pieces or frames <= self.model.back_frames:
            with _AUTOTUNE_LOCK:
                autotune, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
                try:
                    with plain_launches():
                        return self.model.prime(codes, start, state)
                finally:
                    torch.backends.cudnn.benchmark = autotune
        hidden, offset = [], 0
        for size in pieces:
            graph, inputs, (piece, next_state) = self.front_graphs[size]
            inputs["codes"].copy_(codes[:, offset : offset + size])
            inputs["start"].copy_(start + offset)
            inputs["state"].copy_(state)
            graph.replay()
            hidden.append(piece.clone())
            state = next_state.clone()
            offset += size
        graph, inputs, (_, next_state) = self.back_graph
        inputs["hidden"].copy_(torch.cat(hidden, dim=-1)[..., -self.model.back_frames :])
        inputs["state"].copy_(state)
        graph.replay()
        return next_state.clone()

    def _captured_pieces(self, bucket: int, frames: int) -> tuple[int, ...] | None:
        sizes = tuple(sorted(f for b, f in self.graphs if b == bucket))
        return split_frames(frames, sizes) if sizes else None
