"""What the engine drives, whatever the model family: rows of state, one frame step per call.

Running requests occupy rows 0..B-1 of every buffer (the engine keeps them contiguous by moving the
last row into a freed one), so a batch is a prefix of each buffer and the per-frame work has static
shapes per batch size. On a GPU the whole frame step is captured as one CUDA graph per (batch bucket,
attention-span bucket); a step pads the batch and the span up to the next bucket, in eager mode too,
so graph and eager runs compute the same shapes and draw the same codes. The host learns one
[B, codebooks + 1] array per frame step: the frame's codes and a last column that says, when it
equals `end_marker`, that the frame is its request's last (end of speech).

A family's runner subclasses this with its state (`RowState` or a subclass), its KV `cache`, its
`prefill` and its `_decode_into_output`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import check_kernels
from .codec_runner import capture_stream


class FrameRunner:
    end_marker: int  # a step output's last column equal to this ends the row's request

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        max_rows: int,
        max_positions: int,
        max_text_tokens: int,
        codebooks: int,
        prefill_stream: torch.cuda.Stream | None = None,
    ):
        """prefill_stream: where a family's prefills may run, beside the frame step in flight; None: on
        the caller's stream, between steps."""
        self.device, self.dtype = device, dtype
        check_kernels(self.device)  # decided now, before any graph capture
        self.max_rows, self.max_positions, self.max_text_tokens = max_rows, max_positions, max_text_tokens
        self.row_offsets = torch.arange(max_rows, device=self.device)
        self.move_pair = torch.zeros(2, device=self.device, dtype=torch.long)  # (source, target): `move_row`
        self.step_output = torch.zeros(max_rows, codebooks + 1, device=self.device, dtype=torch.long)
        # Host transfers get a stream of their own: on the compute stream a pageable copy would wait
        # for the frame step in flight (pinned memory would not, but aborts under a green context).
        self.transfer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stashed_codes = [torch.zeros_like(self.step_output) for _ in range(2)]  # see `stash_codes`
        self.stashes = 0
        self.prefill_stream = prefill_stream
        # Recorded on the compute stream once it has read a prefill's inputs and outputs, which the
        # next prefill overwrites.
        self.prefill_read = torch.cuda.Event() if prefill_stream is not None else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.move_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per attention-span bucket: see `move_row`
        self.batch_buckets: list[int] = []
        self.span_buckets: list[int] = []

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, for use on the current stream, without waiting for its work."""
        if self.transfer_stream is None:
            return tensor
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.transfer_stream):
            uploaded = tensor.to(self.device)
        compute.wait_stream(self.transfer_stream)
        uploaded.record_stream(compute)  # allocated on the transfer stream, used on the compute stream
        return uploaded

    def stash_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Keep a frame step's codes [B, codebooks + 1] for the host: the next step overwrites `decode`'s
        output. On a GPU: a copy into one of two buffers (read before the step after next), and an
        event for when it is there."""
        if self.transfer_stream is None:
            return codes.clone(), None
        stash = self.stashed_codes[self.stashes % 2][: len(codes)]
        self.stashes += 1
        stash.copy_(codes)
        ready = torch.cuda.Event()
        ready.record()
        return stash, ready

    def read_codes(self, stash: torch.Tensor, ready: torch.cuda.Event | None) -> np.ndarray:
        """Stashed codes on the host, once they are ready (not waiting for the steps queued after them)."""
        if ready is None:
            return stash.numpy()
        ready.synchronize()
        with torch.cuda.stream(self.transfer_stream):
            return stash.to("cpu").numpy()

    # -- rows ----------------------------------------------------------------------------------

    def move_row(self, source: int, target: int, length: int) -> None:
        """Move a running request from row `source` to row `target` (its first `length` positions, up
        to their attention-span bucket). The rows go in as fills of a static index pair, so one graph
        per span bucket moves any row: five PyTorch calls on the engine thread instead of 34."""
        self.move_pair[0].fill_(source)
        self.move_pair[1].fill_(target)
        span = self._bucket(length, self.span_buckets)
        graph = self.move_graphs.get(span)
        if graph is not None:
            graph.replay()
        else:
            self._move_row_by_index(span)

    def _move_row_by_index(self, span: int) -> None:
        source, target = self.move_pair[:1], self.move_pair[1:]
        self.state.move(source, target)
        for cache in (self.cache.keys, self.cache.values):
            window = cache[:, :, :, :span]
            window.index_copy_(1, target, window.index_select(1, source))

    # -- steps ----------------------------------------------------------------------------------

    def set_buckets(self, batch_sizes: list[int], spans: list[int]) -> None:
        """Pad steps to these batch sizes and attention spans (needed for graphs, allowed without)."""
        self.batch_buckets = sorted(b for b in set(batch_sizes) if b <= self.max_rows)
        self.span_buckets = sorted(s for s in set(spans) if s <= self.max_positions)

    @staticmethod
    def _bucket(value: int, buckets: list[int]) -> int:
        return next((b for b in buckets if b >= value), value)

    def graph_counts(self) -> dict[str, int]:
        """CUDA graphs captured, by kind (for the server's log)."""
        return {"frame step": len(self.graphs), "row move": len(self.move_graphs)}

    def _capture_steps(self):
        """Capture the frame step for every (batch, span) bucket and the row move for every span;
        returns the graphs' memory pool. The caller restores the rows' state afterwards."""
        pool = None
        for span in reversed(self.span_buckets):  # largest first: later graphs reuse its memory pool
            for batch in reversed(self.batch_buckets):
                self.state.reset(slice(0, batch))
                graph, pool = self._capture(lambda: self._decode_into_output(batch, span), pool)
                self.graphs[(batch, span)] = graph
            # Captured moving row 0 onto itself.
            self.move_graphs[span], pool = self._capture(lambda: self._move_row_by_index(span), pool)
        return pool

    def _capture(self, work, pool, keep_output: bool = False, stream: torch.cuda.Stream | None = None):
        for _ in range(2):  # warm up kernels and autotuning outside the capture
            work()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream or capture_stream(self.device)):
            output = work()
        return ((graph, output) if keep_output else graph), graph.pool()

    @torch.inference_mode()
    def decode(self, batch: int, span: int) -> torch.Tensor:
        """One frame for rows 0..batch-1: returns [batch, codebooks + 1] (see the module's docstring).

        span: attention length, at least every row's position + 1. Both are padded to their buckets;
        padding rows compute throw-away frames.
        """
        padded, span = self._bucket(batch, self.batch_buckets), self._bucket(span, self.span_buckets)
        if padded > batch:
            self.state.reset(slice(batch, padded))
        graph = self.graphs.get((padded, span))
        if graph is not None:
            graph.replay()
        else:
            self._decode_into_output(padded, span)
        return self.step_output[:batch]

    def _decode_into_output(self, batch: int, span: int) -> None:
        raise NotImplementedError
