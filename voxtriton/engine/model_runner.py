"""Tensors of the engine: the model, its KV cache, every running request's row state, CUDA graphs.

Running requests occupy rows 0..B-1 of every buffer (the engine keeps them contiguous by moving the
last row into a freed one), so a batch is a prefix of each buffer and the per-frame work has static
shapes per batch size. On a GPU the whole frame step (15 code-predictor steps with sampling, the
talker step, codebook-0 sampling) is captured as one CUDA graph per (batch bucket, attention-span
bucket); a step pads the batch and the span up to the next bucket, in eager mode too, so graph and
eager runs compute the same shapes and draw the same codes. Nothing here branches on a request in
Python; the host learns one [B, 17] array per frame step.

Admissions take their first frame in the prefill: the prompt, its codebook-0 token and a whole frame
step run on a small set of rows of their own, beside the step in flight, and the new rows join the
batch one frame in. Otherwise a request admitted while step k runs would get its first frame from
step k+1, a whole step later.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..kernels import triton_usable
from ..models.config import Qwen3TTSConfig
from ..models.layers import StaticKV
from ..models.talker import Qwen3TTSBackbone
from .codec_runner import capture_stream
from .request import Request
from .sampling import RowParams, apply_repetition_penalty, fold_seed, gumbel_noise, sample

NO_CODEC = -1


class Rows:
    """Everything a frame step reads or writes, one row per request: the caches it attends to, the
    codes and hidden state it continues from, the sampling parameters and the step's output.

    The runner keeps two sets: the running batch's (`ModelRunner.rows`), and a small one where
    admitted prompts prefill and take their first frame beside the step in flight
    (`ModelRunner.admission`), copied into the batch's rows afterwards."""

    def __init__(self, config: Qwen3TTSConfig, count: int, positions: int, predictor_length: int,
                 max_text_tokens: int, device: torch.device, dtype: torch.dtype):
        t, p = config.talker.transformer, config.talker.predictor
        zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, device=device, dtype=dtype)
        long = torch.long
        self.cache = StaticKV(zeros(t.num_layers, count, t.num_kv_heads, positions, t.head_dim),
                              zeros(t.num_layers, count, t.num_kv_heads, positions, t.head_dim))
        # Scratch of the code predictor, rewritten every frame: nothing in it outlives a step.
        self.predictor_keys = zeros(p.num_layers, count, p.num_kv_heads, predictor_length, p.head_dim)
        self.predictor_values = torch.zeros_like(self.predictor_keys)
        self.last_code = zeros(count, dtype=long)  # codebook-0 token of the frame to complete next
        self.past_hidden = zeros(count, t.hidden_size)  # talker output that produced it
        self.frame_index = zeros(count, dtype=long)
        self.position = zeros(count, dtype=long)
        # Trailing text ids, padded with tts_pad: row r feeds trailing[r, min(frame, last column)].
        self.trailing = torch.full((count, max_text_tokens + 1), config.tts_pad_token_id, device=device, dtype=long)
        self.seen = zeros(count, config.talker.vocab_size, dtype=torch.bool)
        self.penalty = torch.ones(count, device=device, dtype=torch.float32)
        self.ignore_eos = zeros(count, dtype=torch.bool)
        self.main = RowParams(zeros(count, dtype=torch.float32), zeros(count, dtype=long),
                              zeros(count, dtype=torch.float32), zeros(count, dtype=long))
        self.sub = RowParams(zeros(count, dtype=torch.float32), zeros(count, dtype=long),
                             zeros(count, dtype=torch.float32), self.main.seeds)
        self.step_output = zeros(count, config.talker.num_code_groups + 1, dtype=long)
        # What a row carries from one frame to the next (the caches apart).
        self.tensors = [self.last_code, self.past_hidden, self.frame_index, self.position, self.trailing,
                        self.seen, self.penalty, self.ignore_eos, self.main.temperature, self.main.top_k,
                        self.main.top_p, self.main.seeds, self.sub.temperature, self.sub.top_k, self.sub.top_p]

    def copy_rows(self, target: slice, source: "Rows", source_rows: slice, positions: int) -> None:
        """Rows of `source` (their first `positions` cache entries) into rows `target` of this set."""
        for mine, theirs in zip(self.tensors, source.tensors):
            mine[target] = theirs[source_rows]
        self.cache.keys[:, target, :, :positions] = source.cache.keys[:, source_rows, :, :positions]
        self.cache.values[:, target, :, :positions] = source.cache.values[:, source_rows, :, :positions]


class ModelRunner:
    def __init__(self, model: Qwen3TTSBackbone, max_rows: int, max_positions: int, max_text_tokens: int,
                 prefill_stream: torch.cuda.Stream | None = None):
        """prefill_stream: where padded prefills run, beside the frame step in flight (see
        `_beside_the_step`); None: on the caller's stream, between steps."""
        config: Qwen3TTSConfig = model.config
        self.model, self.config = model, config
        talker = model.talker
        self.talker = talker
        param = talker.codec_head.weight
        self.device, self.dtype = param.device, param.dtype
        triton_usable(self.device)  # decided now, before any graph capture
        self.max_rows, self.max_positions = max_rows, max_positions
        self.max_text_tokens = max_text_tokens
        self.rows = self._new_rows(max_rows, max_positions)
        vocab = config.talker.vocab_size
        # Codebook-0 tokens the official generation never samples: the control ids above the
        # codec codebook, except end-of-speech.
        eos = config.talker.codec_eos_id
        self.suppressed = torch.arange(vocab, device=self.device) >= vocab - 1024
        self.suppressed[eos] = False
        self.is_eos = torch.arange(vocab, device=self.device) == eos
        self.vocab = vocab
        self.code_groups = torch.arange(config.talker.num_code_groups, device=self.device)
        # Host transfers go through a stream of their own: a copy to or from pageable memory waits for
        # the work queued before it on its stream, which on the compute stream is a frame step in
        # flight. (Pinned memory would avoid that, but allocating it under a green context aborts.)
        self.transfer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Two for the frame steps (see `stash_codes`), one for the admissions' first frames.
        self.stashed_codes = [torch.zeros_like(self.rows.step_output) for _ in range(3)]
        self.stashes = 0
        self.prefill_stream = prefill_stream
        # Recorded on the compute stream once it has read an admission's rows (`admission`), which
        # the next admission overwrites.
        self.prefill_read = torch.cuda.Event() if prefill_stream is not None else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.set_buckets([], [])

    def _new_rows(self, count: int, positions: int) -> Rows:
        return Rows(self.config, count, positions, self.talker.code_predictor.cache_length, self.max_text_tokens,
                    self.device, self.dtype)

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
        """Keep a frame step's codes [B, groups + 1] for the host: the next step overwrites `decode`'s
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
        """Move a running request from row `source` to row `target` (its first `length` positions)."""
        self.rows.copy_rows(slice(target, target + 1), self.rows, slice(source, source + 1), length)

    def _set_params(self, rows: Rows, requests: list[Request]) -> None:
        """Write new requests' row state into the first rows of `rows`: one upload for the scalars, one
        for the trailing text."""
        count = len(requests)
        columns = [(rows.penalty, "repetition_penalty"), (rows.ignore_eos, "ignore_eos"),
                   (rows.main.temperature, "temperature"), (rows.main.top_k, "top_k"), (rows.main.top_p, "top_p"),
                   (rows.sub.temperature, "sub_temperature"), (rows.sub.top_k, "sub_top_k"),
                   (rows.sub.top_p, "sub_top_p")]
        # float64 holds every value exactly (seeds have 31 bits, top-k and positions are small).
        scalars = torch.tensor([[float(getattr(r.params, name)) for _, name in columns]
                                + [float(fold_seed(r.params.seed)), float(len(r.prompt.text_ids))] for r in requests],
                               dtype=torch.float64)
        scalars = self._upload(scalars)
        for index, (tensor, _) in enumerate(columns):
            tensor[:count] = scalars[:, index].to(tensor.dtype)
        rows.main.seeds[:count] = scalars[:, -2].long()
        rows.position[:count] = scalars[:, -1].long()
        trailing = torch.full((count, rows.trailing.shape[1]), self.config.tts_pad_token_id, dtype=torch.long)
        for i, request in enumerate(requests):
            ids = request.prompt.trailing_text_ids
            trailing[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        rows.trailing[:count] = self._upload(trailing)
        rows.seen[:count] = False
        rows.frame_index[:count] = 0

    # -- codebook 0 --------------------------------------------------------------------------------

    def _sample_first_codebook(self, rows: Rows, batch: int, logits: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
        """Penalties, suppression and the official minimum of two frames, then sampling, for rows
        0..batch-1 of `rows` (their frame_index: frames already completed)."""
        part = slice(0, batch)
        logits = apply_repetition_penalty(logits.float(), rows.seen[part], rows.penalty[part])
        block_eos = (rows.frame_index[part] < 2) | rows.ignore_eos[part]
        logits = logits.masked_fill(self.suppressed | (block_eos[:, None] & self.is_eos), float("-inf"))
        params = RowParams(rows.main.temperature[part], rows.main.top_k[part], rows.main.top_p[part],
                           rows.main.seeds[part])
        code = sample(logits, params, gumbel)
        rows.seen[part].scatter_(1, code[:, None], True)
        return code

    # -- steps ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, requests: list[Request], first_row: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Run the prompts of new requests and their first frame step into rows first_row.. .

        Returns the first frames' codes (as `decode` returns a step's, [len(requests), 17]) and, on a
        GPU, the event after which they can be read. The rows are then one frame in: the next step
        gives them their second frame. Admissions larger than the largest prefill batch bucket go in
        groups of that size.
        """
        group = max(self.prefill_batch_buckets, default=len(requests))
        codes = self.stashed_codes[2][: len(requests)]
        for start in range(0, len(requests), group):
            part = requests[start: start + group]
            self._prefill_group(part, first_row + start, codes[start: start + len(part)])
        if self.transfer_stream is None:
            return codes.clone(), None
        ready = torch.cuda.Event()
        ready.record()
        return codes, ready

    def _prefill_group(self, requests: list[Request], first_row: int, first_frames: torch.Tensor) -> None:
        """One group of `prefill`, its first frames into `first_frames`."""
        count = len(requests)
        lengths = [len(r.prompt.text_ids) for r in requests]
        batch = self._bucket(count, self.prefill_batch_buckets)
        length = self._bucket(max(lengths), self.prefill_length_buckets)
        padded = batch in self.prefill_batch_buckets and length in self.prefill_length_buckets
        if not padded:  # no bucket fits: eager, exact shapes, on rows made for it
            batch, length = count, max(lengths)
        text = torch.zeros(batch, length, dtype=torch.long)
        codec = torch.full((batch, length), NO_CODEC, dtype=torch.long)
        for i, request in enumerate(requests):
            text[i, : lengths[i]] = torch.tensor(request.prompt.text_ids)
            codec[i, : lengths[i]] = torch.tensor(request.prompt.codec_ids)
        last_index = torch.tensor(lengths + [1] * (batch - count)) - 1
        if padded:
            rows = self.admission
            with self._beside_the_step():
                self._set_params(rows, requests)
                self._reset_rows(rows, slice(count, batch))
                self.prefill_text[:batch, :length].copy_(self._upload(text))
                self.prefill_codec[:batch, :length].copy_(self._upload(codec))
                self.prefill_last[:batch].copy_(self._upload(last_index))
                graph = self.prefill_graphs.get((batch, length))
                if graph is not None:
                    graph.replay()
                else:
                    self._first_frame_padded(batch, length)
        else:
            rows = self._new_rows(count, length + 1)
            self._set_params(rows, requests)
            self._first_frame(rows, self._upload(text), self._upload(codec), self._upload(last_index))
        # Padding positions beyond a prompt are overwritten by its frames before any step reads them.
        self.rows.copy_rows(slice(first_row, first_row + count), rows, slice(0, count), length + 1)
        first_frames.copy_(rows.step_output[:count])
        if padded and self.prefill_read is not None:
            self.prefill_read.record()

    @contextlib.contextmanager
    def _beside_the_step(self):
        """Run the block on the prefill stream, so an admission overlaps the frame step in flight
        instead of queueing behind it; the caller's stream then waits for it. The block must touch
        only the admission's own buffers (`admission`, the static inputs, graph outputs): rows beyond
        the batch are padding rows of the step in flight. It starts once the caller's stream has read
        the previous admission's rows; memory it allocates (eager runs) is reused only after that too."""
        if self.prefill_stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.prefill_stream.wait_event(self.prefill_read)
        with torch.cuda.stream(self.prefill_stream):
            yield
        caller.wait_stream(self.prefill_stream)

    def _first_frame(self, rows: Rows, text: torch.Tensor, codec: torch.Tensor, last_index: torch.Tensor) -> None:
        """Prompts [B, L] into the first B of `rows` (parameters set, positions at the prompts' ends),
        their codebook-0 tokens, then one frame step: rows.step_output[:B] is the first frame."""
        batch, length = text.shape
        cache = StaticKV(rows.cache.keys[:, :batch], rows.cache.values[:, :batch])
        positions = torch.arange(length, device=self.device).expand(batch, length)
        hidden = self.talker(self.talker.prompt_embeds(text, codec), positions, cache, length)
        last = hidden[torch.arange(batch, device=self.device), last_index]
        rows.past_hidden[:batch] = last
        gumbel = gumbel_noise(rows.main.seeds[:batch], rows.frame_index[:batch, None], self.code_groups[:1], self.vocab)
        rows.last_code[:batch] = self._sample_first_codebook(rows, batch, self.talker.codec_head(last), gumbel[:, 0])
        self._decode_into_output(rows, batch, length + 1)

    def _first_frame_padded(self, batch: int, length: int) -> None:
        """`_first_frame` of one (batch, length) bucket on the static buffers (what its graph replays)."""
        self._first_frame(self.admission, self.prefill_text[:batch, :length], self.prefill_codec[:batch, :length],
                          self.prefill_last[:batch])

    def set_buckets(self, batch_sizes: list[int], spans: list[int], prefill_batch_sizes: list[int] = (),
                    prefill_lengths: list[int] = ()) -> None:
        """Pad steps to these batch sizes and attention spans, and prompts to these prefill batch sizes
        and lengths (needed for graphs, allowed without)."""
        self.batch_buckets = sorted(b for b in set(batch_sizes) if b <= self.max_rows)
        self.span_buckets = sorted(s for s in set(spans) if s <= self.max_positions)
        self.prefill_batch_buckets = sorted(b for b in set(prefill_batch_sizes) if b <= self.max_rows)
        # A first frame writes one position past its prompt.
        self.prefill_length_buckets = sorted(n for n in set(prefill_lengths) if n < self.max_positions)
        if self.prefill_batch_buckets and self.prefill_length_buckets:
            batch, length = self.prefill_batch_buckets[-1], self.prefill_length_buckets[-1]
            self.admission = self._new_rows(batch, length + 1)
            self.prefill_text = torch.zeros(batch, length, device=self.device, dtype=torch.long)
            self.prefill_codec = torch.full((batch, length), NO_CODEC, device=self.device, dtype=torch.long)
            self.prefill_last = torch.zeros(batch, device=self.device, dtype=torch.long)
        else:
            self.prefill_batch_buckets, self.prefill_length_buckets = [], []

    @staticmethod
    def _bucket(value: int, buckets: list[int]) -> int:
        return next((b for b in buckets if b >= value), value)

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: list[int], spans: list[int], prefill_batch_sizes: list[int] = (),
                       prefill_lengths: list[int] = ()) -> None:
        """Capture the frame step for every (batch, span) bucket and the admission (prefill and first
        frame) for every (batch, length) bucket. Run before any request is admitted."""
        self.set_buckets(batch_sizes, spans, prefill_batch_sizes, prefill_lengths)
        pool = None
        for span in reversed(self.span_buckets):  # largest first: later graphs reuse its memory pool
            for batch in reversed(self.batch_buckets):
                self._reset_rows(self.rows, slice(0, batch))
                graph, pool = self._capture(lambda: self._decode_into_output(self.rows, batch, span), pool)
                self.graphs[(batch, span)] = graph
        # An admission may run beside a frame step (`_beside_the_step`), so its graphs get a memory
        # pool of their own (graphs sharing a pool share their intermediate buffers) and are captured
        # on the prefill stream (a graph keeps the cuBLAS workspace of the stream it was captured on).
        prefill_pool, stream = None, self.prefill_stream or capture_stream(self.device)
        for length in reversed(self.prefill_length_buckets):
            for batch in reversed(self.prefill_batch_buckets):
                self.prefill_last[:batch] = length - 1
                # Each warm-up's frame step advances the rows: back to the prompts' ends before the next.
                graph, prefill_pool = self._capture(
                    lambda: self._first_frame_padded(batch, length), prefill_pool, stream=stream,
                    prepare=lambda: self._reset_rows(self.admission, slice(0, batch), position=length))
                self.prefill_graphs[(batch, length)] = graph
        self._reset_rows(self.rows, slice(0, self.max_rows))
        torch.cuda.synchronize(self.device)

    def _capture(self, work, pool, stream: torch.cuda.Stream | None = None, prepare=lambda: None):
        for _ in range(2):  # warm up kernels and autotuning outside the capture
            prepare()
            work()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream or capture_stream(self.device)):
            work()
        return graph, graph.pool()

    @staticmethod
    def _reset_rows(rows: Rows, part: slice, position: int = 0) -> None:
        """Put rows that no request uses in a harmless state (positions inside the cache)."""
        rows.position[part] = position
        rows.frame_index[part] = 0

    @torch.inference_mode()
    def decode(self, batch: int, span: int) -> torch.Tensor:
        """One frame for rows 0..batch-1: returns [batch, 17] = the frame's 16 codes + next codebook-0 token.

        span: attention length, at least every row's position + 1. Both are padded to their buckets;
        padding rows compute throw-away frames.
        """
        padded, span = self._bucket(batch, self.batch_buckets), self._bucket(span, self.span_buckets)
        if padded > batch:
            self._reset_rows(self.rows, slice(batch, padded))
        graph = self.graphs.get((padded, span))
        if graph is not None:
            graph.replay()
        else:
            self._decode_into_output(self.rows, padded, span)
        return self.rows.step_output[:batch]

    def _decode_into_output(self, rows: Rows, batch: int, span: int) -> None:
        """One frame step for rows 0..batch-1 of `rows`, into rows.step_output."""
        part = slice(0, batch)
        frames = rows.frame_index[part].clone()
        talker = self.talker
        # Noise for the whole step at once: groups 1..15 complete this frame, group 0 starts the next.
        groups = self.code_groups
        gumbel = gumbel_noise(rows.main.seeds[part], frames[:, None] + (groups == 0), groups, self.vocab)
        sub = RowParams(rows.sub.temperature[part], rows.sub.top_k[part], rows.sub.top_p[part], rows.sub.seeds[part])
        residual = talker.code_predictor.predict_frame(
            rows.past_hidden[part], talker.model.codec_embedding(rows.last_code[part]),
            rows.predictor_keys, rows.predictor_values, lambda logits, group: sample(logits, sub, gumbel[:, group]))
        frame = torch.cat((rows.last_code[part, None], residual), dim=1)
        text = rows.trailing[part].gather(1, frames.clamp(max=self.max_text_tokens)[:, None])[:, 0]
        embeds = (talker.frame_embeds(frame) + talker.text_embeds(text))[:, None]
        hidden = talker(embeds, rows.position[part, None], rows.cache, span)[:, 0]
        rows.frame_index[part] += 1
        rows.position[part] += 1
        rows.past_hidden[part] = hidden
        rows.last_code[part] = self._sample_first_codebook(rows, batch, talker.codec_head(hidden), gumbel[:, 0])
        rows.step_output[part, :-1] = frame
        rows.step_output[part, -1] = rows.last_code[part]
