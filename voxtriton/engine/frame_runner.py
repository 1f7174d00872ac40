"""What the engine drives, whatever the model family: rows of state, one frame step per call.

Running requests occupy rows 0..B-1 of every buffer (the engine keeps them contiguous by moving the
last row into a freed one), so a batch is a prefix of each buffer and the per-frame work has static
shapes per batch size. On a GPU the whole frame step is captured as one CUDA graph per (batch bucket,
attention-span bucket); a step pads the batch and the span up to the next bucket, in eager mode too,
so graph and eager runs compute the same shapes and draw the same codes. The host learns one
[B, codebooks + 1] array per frame step: the frame's codes and a last column that says, when it
equals `end_marker`, that the frame is its request's last (end of speech).

Prefills pad prompts to (batch, length) buckets too, when buckets are set: one upload into a static
admission buffer, the prompts through the backbone into a scratch KV cache (beside the frame step in
flight, on the prefill stream), then the admitted rows written. On a GPU the last two are CUDA
graphs, per (batch, length) bucket and per (requests, length). Prompts no bucket fits prefill
eagerly at their exact shapes, straight into their rows.

A family's runner subclasses this with its state (a `Rows` subclass), its KV `cache`, `pad_text_id`,
`_prompt_last_hidden` (prompts through the backbone), `_write_admitted` (the admitted rows and their
first step) and `_decode_into_output` (the frame step).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..kernels import check_kernels
from ..models.layers import StaticKV
from .admission import AdmissionInputs, AdmissionLayout
from .codec_runner import capture_stream
from .request import Request

NO_CODEC = -1  # an admission's codec ids past a prompt's


class FrameRunner:
    end_marker: int  # a step output's last column equal to this ends the row's request
    # ... and equal to this, the frame itself is the end: the request ends without it (a family
    # whose first frame can be its end frame); None: never.
    empty_end_marker: int | None = None
    pad_text_id: int  # what fills the trailing text of an admission's rows
    extra_width = 0  # the width of a family's extra prompt embeddings (`_extra_embeds`); 0: none
    # A family whose frame step completes each row's frame (`_complete_frame_into_output`) before it
    # advances the backbone (`_advance_into_output`), and whose first frame is never its request's
    # last: the host may take first frames after the step's first part (`complete_first_frames`).
    early_first_frames = False

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
        self.codebooks = codebooks
        self.row_offsets = torch.arange(max_rows, device=self.device)
        self.move_pair = torch.zeros(2, device=self.device, dtype=torch.long)  # (source, target): `move_row`
        self.step_output = torch.zeros(max_rows, codebooks + 1, device=self.device, dtype=torch.long)
        # Host transfers get a stream of their own: on the compute stream a pageable copy would wait
        # for the frame step in flight (pinned memory would not, but aborts under a green context).
        self.transfer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stashed_codes = [torch.zeros_like(self.step_output) for _ in range(2)]  # see `stash_codes`
        self.first_frames = torch.zeros_like(self.step_output)  # see `complete_first_frames`
        self.advance_pending: tuple[int, int] | None = None  # (batch, span) buckets: see `advance`
        self.stashes = 0
        self.prefill_stream = prefill_stream
        # Recorded on the compute stream once it has read a prefill's inputs and outputs, which the
        # next prefill overwrites.
        self.prefill_read = torch.cuda.Event() if prefill_stream is not None else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # The frame step in its two parts, for batch buckets up to `split_batch`: the first (which
        # attends to no KV cache of any span) per batch bucket, the second per (batch, span) bucket.
        self.first_part_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.second_part_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.split_batch = 0
        self.move_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per attention-span bucket: see `move_row`
        self.prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Writing admitted requests' rows, per (requests, prompt-length bucket): see `_write_admitted`.
        self.admission_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.batch_buckets: list[int] = []
        self.span_buckets: list[int] = []
        self.prefill_batch_buckets: list[int] = []
        self.prefill_length_buckets: list[int] = []
        self.prefill_extra: torch.Tensor | None = None  # a family's extra prompt embeddings, if any

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
        self._check_no_advance_pending()
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
        for cache in self.cache.storage():
            window = cache[:, :, :, :span]
            window.index_copy_(1, target, window.index_select(1, source))

    # -- steps ----------------------------------------------------------------------------------

    def set_buckets(
        self,
        batch_sizes: list[int],
        spans: list[int],
        prefill_batch_sizes: list[int] = (),
        prefill_lengths: list[int] = (),
    ) -> None:
        """Pad steps to these batch sizes and attention spans, and prompts to these prefill batch sizes
        and lengths (needed for graphs, allowed without)."""
        self.batch_buckets = sorted(b for b in set(batch_sizes) if b <= self.max_rows)
        self.span_buckets = sorted(s for s in set(spans) if s <= self.max_positions)
        self.prefill_batch_buckets = sorted(b for b in set(prefill_batch_sizes) if b <= self.max_rows)
        self.prefill_length_buckets = sorted(n for n in set(prefill_lengths) if n <= self.max_positions)
        if not (self.prefill_batch_buckets and self.prefill_length_buckets):
            self.prefill_batch_buckets, self.prefill_length_buckets = [], []
            return
        batch, length = self.prefill_batch_buckets[-1], self.prefill_length_buckets[-1]
        self.prefill_kv = self.cache.like(batch, length)
        self.admission_layout = AdmissionLayout(batch, self.trailing_width)
        self.admission = torch.zeros(
            self.admission_layout.size(batch, length), device=self.device, dtype=torch.long
        )
        if self.extra_width:
            # A family's extra prompt embeddings: zeros except during a prefill that has some.
            shape = (batch, length, self.extra_width)
            self.prefill_extra = torch.zeros(shape, device=self.device, dtype=self.dtype)

    @property
    def trailing_width(self) -> int:
        """Trailing text ids an admission carries per row (a family that feeds text per frame: more)."""
        return 1

    @staticmethod
    def _bucket(value: int, buckets: list[int]) -> int:
        return next((b for b in buckets if b >= value), value)

    def graph_counts(self) -> dict[str, int]:
        """CUDA graphs captured, by kind (for the server's log)."""
        return {
            "frame step": len(self.graphs),
            "frame step's first part": len(self.first_part_graphs),
            "frame step's second part": len(self.second_part_graphs),
            "row move": len(self.move_graphs),
            "prefill": len(self.prefill_graphs),
            "admission": len(self.admission_graphs),
        }

    @torch.inference_mode()
    def capture_graphs(
        self,
        batch_sizes: list[int],
        spans: list[int],
        prefill_batch_sizes: list[int] = (),
        prefill_lengths: list[int] = (),
        first_frame_rows: int = 0,
    ) -> None:
        """Capture the frame step for every (batch, span) bucket and the prefill for every (batch,
        length) bucket, and, for a family with `early_first_frames`, the step in its two parts for the
        batch buckets that hold up to `first_frame_rows` rows. Run before any request is admitted."""
        self.set_buckets(batch_sizes, spans, prefill_batch_sizes, prefill_lengths)
        if self.early_first_frames and first_frame_rows > 0:
            self.split_batch = self._bucket(first_frame_rows, self.batch_buckets)
        # Captures run their work on rows 0.. with placeholder inputs (and graph outputs never written):
        # the rows' state goes back to this afterwards.
        initial_rows = [tensor.clone() for tensor in self.state.tensors]
        pool = self._capture_steps()
        # Prefills may run beside a frame step (`_beside_the_step`): their graphs get a pool of their own
        # and are captured on the prefill stream, whose cuBLAS workspace they keep.
        prefill_pool, stream = None, self.prefill_stream or capture_stream(self.device)
        for length in reversed(self.prefill_length_buckets):
            for batch in reversed(self.prefill_batch_buckets):
                graph, prefill_pool = self._capture(
                    lambda: self._prefill_padded(batch, length), prefill_pool, keep_output=True, stream=stream
                )
                self.prefill_graphs[(batch, length)] = graph
        # The rows' writes run on the compute stream between frame steps: the steps' pool serves them.
        for length in self.prefill_length_buckets:
            for count in range(1, max(self.prefill_batch_buckets, default=0) + 1):
                batch = self._bucket(count, self.prefill_batch_buckets)
                last = self.prefill_graphs[(batch, length)][1]
                self.admission_graphs[(count, length)], pool = self._capture(
                    lambda: self._write_admitted(self._admission_inputs(count, batch, length), last, length),
                    pool,
                )
        for tensor, initial in zip(self.state.tensors, initial_rows):
            tensor.copy_(initial)
        torch.cuda.synchronize(self.device)

    def _capture_steps(self):
        """Capture the frame step for every (batch, span) bucket and the row move for every span;
        returns the graphs' memory pool. The caller restores the rows' state afterwards."""
        pool = None
        for span in reversed(self.span_buckets):  # largest first: later graphs reuse its memory pool
            for batch in reversed(self.batch_buckets):
                self.state.reset(slice(0, batch))
                graph, pool = self._capture(lambda: self._decode_into_output(batch, span), pool)
                self.graphs[(batch, span)] = graph
                if batch <= self.split_batch:
                    self.state.reset(slice(0, batch))
                    if batch not in self.first_part_graphs:
                        self.first_part_graphs[batch], pool = self._capture(
                            lambda: self._complete_frame_into_output(batch), pool
                        )
                    self.second_part_graphs[(batch, span)], pool = self._capture(
                        lambda: self._advance_into_output(batch, span), pool
                    )
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
        self._check_no_advance_pending()
        padded, span = self._padded(batch, span)
        graph = self.graphs.get((padded, span))
        if graph is not None:
            graph.replay()
        else:
            self._decode_into_output(padded, span)
        return self.step_output[:batch]

    @torch.inference_mode()
    def complete_first_frames(self, batch: int, span: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The first part of `decode` (`early_first_frames`): every row's frame completed, and a copy of
        the frames [batch, codebooks + 1] for the host (its last column means nothing) with an event
        for when it is there (None on a CPU). `advance` launches the rest of the step; nothing else
        may run on the rows in between. The host can read a first frame while the backbone advances,
        or before it does."""
        self._check_no_advance_pending()
        padded, span = self._padded(batch, span)
        first = self.first_part_graphs.get(padded)
        if first is not None:
            first.replay()
        else:
            self._complete_frame_into_output(padded)
        frames = self.first_frames[:batch]
        frames.copy_(self.step_output[:batch])
        ready = None
        if self.transfer_stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self.advance_pending = (padded, span)
        return frames, ready

    @torch.inference_mode()
    def advance(self, batch: int) -> torch.Tensor:
        """The second part of the step `complete_first_frames` began: returns its output, as `decode`."""
        (padded, span), self.advance_pending = self.advance_pending, None
        second = self.second_part_graphs.get((padded, span))
        if second is not None:
            second.replay()
        else:
            self._advance_into_output(padded, span)
        return self.step_output[:batch]

    def _check_no_advance_pending(self) -> None:
        """Nothing else may run on the rows between a split step's two parts."""
        assert self.advance_pending is None, "a split step's second part is still to launch (`advance`)"

    def _padded(self, batch: int, span: int) -> tuple[int, int]:
        """A step's batch and span padded to their buckets (the padding rows reset)."""
        padded, span = self._bucket(batch, self.batch_buckets), self._bucket(span, self.span_buckets)
        if padded > batch:
            self.state.reset(slice(batch, padded))
        return padded, span

    def _decode_into_output(self, batch: int, span: int) -> None:
        raise NotImplementedError

    def _complete_frame_into_output(self, batch: int) -> None:
        """`early_first_frames` families: the frame step's first part (each row's frame into
        `step_output[:, :-1]`)."""
        raise NotImplementedError

    def _advance_into_output(self, batch: int, span: int) -> None:
        """`early_first_frames` families: the frame step's second part (the backbone advanced, the
        last column of `step_output`)."""
        raise NotImplementedError

    # -- prefills -------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, requests: list[Request], first_row: int) -> None:
        """Run the prompts of new requests into rows first_row.. and start their first frames.

        Admissions larger than the largest prefill batch bucket go in groups of that size.
        """
        self._check_no_advance_pending()
        group = max(self.prefill_batch_buckets, default=len(requests))
        for start in range(0, len(requests), group):
            self._prefill_group(requests[start : start + group], first_row + start)

    def _prefill_group(self, requests: list[Request], first_row: int) -> None:
        count, longest = len(requests), max(len(r.prompt.text_ids) for r in requests)
        batch = self._bucket(count, self.prefill_batch_buckets)
        length = self._bucket(longest, self.prefill_length_buckets)
        if batch in self.prefill_batch_buckets and length in self.prefill_length_buckets:
            self._prefill_padded_group(requests, first_row, batch, length)
        else:  # no bucket fits: eager, exact shapes, straight into the rows
            layout = AdmissionLayout(count, self.trailing_width)
            flat = self._upload(torch.from_numpy(self._pack(layout, requests, first_row, count, longest)))
            inputs = layout.views(flat, count, count, longest)
            rows = slice(first_row, first_row + count)
            last = self._prompt_last_hidden(
                inputs.text,
                inputs.codec,
                inputs.last_index,
                self.cache.rows(rows),
                self._extra_embeds(requests, longest),
            )
            self._write_admitted(inputs, last, None)

    def _extra_embeds(self, requests: list[Request], length: int) -> torch.Tensor | None:
        """What a family adds to its prompts' embeddings [count, length, D]; None: nothing."""
        return None

    def _prefill_padded_group(self, requests: list[Request], first_row: int, batch: int, length: int) -> None:
        """Prompts padded to a prefill bucket: one upload into the admission buffer, the prefill (beside
        the step in flight) into the scratch cache, then the rows written: two graph replays on a GPU.
        A family's extra embeddings go into the prefill's extra-embedding buffer for this prefill only,
        so the buffer holds zeros for every other admission."""
        count = len(requests)
        host = torch.from_numpy(self._pack(self.admission_layout, requests, first_row, batch, length))
        with self._beside_the_step():
            self.admission[: host.numel()].copy_(self._upload(host))
            longest = max(len(r.prompt.text_ids) for r in requests)
            extra = self._extra_embeds(requests, longest)
            if extra is not None:
                self.prefill_extra[:count, :longest].copy_(extra)
            entry = self.prefill_graphs.get((batch, length))
            if entry is not None:
                entry[0].replay()
                last = entry[1]
            else:
                last = self._prefill_padded(batch, length)
            if extra is not None:
                self.prefill_extra[:count, :longest].zero_()
        graph = self.admission_graphs.get((count, length))
        if graph is not None:
            graph.replay()
        else:
            self._write_admitted(self._admission_inputs(count, batch, length), last, length)
        if self.prefill_read is not None:
            self.prefill_read.record()

    def _pack(
        self, layout: AdmissionLayout, requests: list[Request], first_row: int, batch: int, length: int
    ) -> np.ndarray:
        return layout.pack(requests, first_row, batch, length, self.pad_text_id, NO_CODEC)

    def _admission_inputs(self, count: int, batch: int, length: int) -> AdmissionInputs:
        return self.admission_layout.views(self.admission, count, batch, length)

    @contextlib.contextmanager
    def _beside_the_step(self):
        """Run the block on the prefill stream, so a prefill overlaps the frame step in flight instead of
        queueing behind it; the caller's stream then waits for it. The block must touch only the
        prefill's own buffers (uploads, static inputs, KV scratch, graph outputs): rows beyond the
        batch are padding rows of the step in flight. It starts once the caller's stream has read the
        previous prefill's outputs; memory it allocates (eager runs) is reused only after that too."""
        if self.prefill_stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.prefill_stream.wait_event(self.prefill_read)
        self.prefill_stream.wait_stream(self.transfer_stream)  # the prompts' uploads
        with torch.cuda.stream(self.prefill_stream):
            yield
        caller.wait_stream(self.prefill_stream)

    def _prefill_padded(self, batch: int, length: int) -> torch.Tensor:
        """The prefill of one (batch, length) bucket from the admission buffer into the scratch cache
        (what its graph replays)."""
        cache = self.prefill_kv.rows(slice(0, batch))
        inputs = self._admission_inputs(batch, batch, length)
        extra = None if self.prefill_extra is None else self.prefill_extra[:batch, :length]
        return self._prompt_last_hidden(inputs.text, inputs.codec, inputs.last_index, cache, extra)

    def _admit_rows(self, inputs: AdmissionInputs, scratch_length: int | None) -> torch.Tensor:
        """Start the admitted rows (`Rows.admit`), with their prompts' KV entries when prefilled into
        the scratch cache (its first `scratch_length` positions); returns the rows' indices, which
        follow the uploaded first row. Padding positions beyond a prompt are overwritten by its frames
        before any step reads them."""
        rows = inputs.first_row + self.row_offsets[: inputs.scalars.shape[0]]
        self.state.admit(rows, inputs)
        if scratch_length is not None:
            for cache, scratch in zip(self.cache.storage(), self.prefill_kv.storage()):
                cache[:, :, :, :scratch_length].index_copy_(
                    1, rows, scratch[:, : len(rows), :, :scratch_length]
                )
        return rows

    def _prompt_last_hidden(
        self,
        text: torch.Tensor,
        codec: torch.Tensor,
        last_index: torch.Tensor,
        cache: StaticKV,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompts [B, L] (text ids, codec ids, plus `extra` embeddings [B, L, D]) into `cache`; returns
        each prompt's final hidden state [B, D]."""
        raise NotImplementedError

    def _write_admitted(
        self, inputs: AdmissionInputs, last_hidden: torch.Tensor, scratch_length: int | None
    ) -> None:
        """Write admitted requests' rows from their inputs and their prompts' last hidden states, with
        their prompts' KV entries when prefilled into the scratch cache (`scratch_length` positions of
        it). The rows follow the uploaded first row, so one graph per (requests, length bucket) serves
        admissions into any rows."""
        raise NotImplementedError
