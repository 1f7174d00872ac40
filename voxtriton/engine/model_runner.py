"""Tensors of the engine: the model, its KV cache, every running request's row state, CUDA graphs.

Running requests occupy rows 0..B-1 of every buffer (the engine keeps them contiguous by moving the
last row into a freed one), so a batch is a prefix of each buffer and the per-frame work has static
shapes per batch size. On a GPU the whole frame step (15 code-predictor steps with sampling, the
talker step, codebook-0 sampling) is captured as one CUDA graph per (batch bucket, attention-span
bucket); a step pads the batch and the span up to the next bucket, in eager mode too, so graph and
eager runs compute the same shapes and draw the same codes. Nothing here branches on a request in
Python; the host learns one [B, 17] array per frame step.
"""

from __future__ import annotations

import torch

from ..models.config import Qwen3TTSConfig
from ..models.layers import StaticKV
from ..models.talker import Qwen3TTSBackbone
from .codec_runner import capture_stream
from .request import Request
from .sampling import RowParams, apply_repetition_penalty, fold_seed, sample

NO_CODEC = -1


class ModelRunner:
    def __init__(self, model: Qwen3TTSBackbone, max_rows: int, max_positions: int, max_text_tokens: int):
        config: Qwen3TTSConfig = model.config
        self.model, self.config = model, config
        talker = model.talker
        self.talker = talker
        param = talker.codec_head.weight
        self.device, self.dtype = param.device, param.dtype
        t, p = config.talker.transformer, config.talker.predictor
        self.max_rows, self.max_positions = max_rows, max_positions
        zeros = lambda *shape, dtype=None: torch.zeros(*shape, device=self.device, dtype=dtype or self.dtype)
        long = torch.long
        self.cache = StaticKV(zeros(t.num_layers, max_rows, t.num_kv_heads, max_positions, t.head_dim),
                              zeros(t.num_layers, max_rows, t.num_kv_heads, max_positions, t.head_dim))
        predictor_length = talker.code_predictor.cache_length
        self.predictor_keys = zeros(p.num_layers, max_rows, p.num_kv_heads, predictor_length, p.head_dim)
        self.predictor_values = torch.zeros_like(self.predictor_keys)
        vocab = config.talker.vocab_size
        # Row state: everything a frame step reads or writes, one row per running request.
        self.last_code = zeros(max_rows, dtype=long)  # codebook-0 token of the frame to complete next
        self.past_hidden = zeros(max_rows, t.hidden_size)  # talker output that produced it
        self.frame_index = zeros(max_rows, dtype=long)
        self.position = zeros(max_rows, dtype=long)
        # Trailing text ids, padded with tts_pad: row r feeds trailing[r, min(frame, last column)].
        self.trailing = torch.full((max_rows, max_text_tokens + 1), config.tts_pad_token_id, device=self.device, dtype=long)
        self.seen = zeros(max_rows, vocab, dtype=torch.bool)
        self.penalty = torch.ones(max_rows, device=self.device, dtype=torch.float32)
        self.ignore_eos = zeros(max_rows, dtype=torch.bool)
        self.main = RowParams(zeros(max_rows, dtype=torch.float32), zeros(max_rows, dtype=long),
                              zeros(max_rows, dtype=torch.float32), zeros(max_rows, dtype=long))
        self.sub = RowParams(zeros(max_rows, dtype=torch.float32), zeros(max_rows, dtype=long),
                             zeros(max_rows, dtype=torch.float32), self.main.seeds)
        self.row_tensors = [self.last_code, self.past_hidden, self.frame_index, self.position, self.trailing,
                            self.seen, self.penalty, self.ignore_eos, self.main.temperature, self.main.top_k,
                            self.main.top_p, self.main.seeds, self.sub.temperature, self.sub.top_k, self.sub.top_p]
        # Codebook-0 tokens the official generation never samples: the control ids above the
        # codec codebook, except end-of-speech.
        eos = config.talker.codec_eos_id
        self.suppressed = torch.arange(vocab, device=self.device) >= vocab - 1024
        self.suppressed[eos] = False
        self.is_eos = torch.arange(vocab, device=self.device) == eos
        self.max_text_tokens = max_text_tokens
        self.step_output = zeros(max_rows, config.talker.num_code_groups + 1, dtype=long)
        self.batch_buckets: list[int] = []
        self.span_buckets: list[int] = []
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    # -- rows ----------------------------------------------------------------------------------

    def move_row(self, source: int, target: int, length: int) -> None:
        """Move a running request from row `source` to row `target` (its first `length` positions)."""
        for tensor in self.row_tensors:
            tensor[target] = tensor[source]
        self.cache.keys[:, target, :, :length] = self.cache.keys[:, source, :, :length]
        self.cache.values[:, target, :, :length] = self.cache.values[:, source, :, :length]

    def _set_params(self, rows: slice, requests: list[Request]) -> None:
        def put(tensor, values):
            tensor[rows] = torch.tensor(values, dtype=tensor.dtype).to(self.device)

        params = [r.params for r in requests]
        put(self.penalty, [p.repetition_penalty for p in params])
        put(self.ignore_eos, [p.ignore_eos for p in params])
        put(self.main.temperature, [p.temperature for p in params])
        put(self.main.top_k, [p.top_k for p in params])
        put(self.main.top_p, [p.top_p for p in params])
        put(self.main.seeds, [fold_seed(p.seed) for p in params])
        put(self.sub.temperature, [p.sub_temperature for p in params])
        put(self.sub.top_k, [p.sub_top_k for p in params])
        put(self.sub.top_p, [p.sub_top_p for p in params])
        trailing = torch.full((len(requests), self.trailing.shape[1]), self.config.tts_pad_token_id, dtype=torch.long)
        for i, request in enumerate(requests):
            ids = request.prompt.trailing_text_ids
            trailing[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.trailing[rows] = trailing.to(self.device)

    # -- codebook 0 --------------------------------------------------------------------------------

    def _sample_first_codebook(self, logits: torch.Tensor, rows: slice, frames: torch.Tensor) -> torch.Tensor:
        """Penalties, suppression and the official minimum of two frames, then sampling."""
        logits = apply_repetition_penalty(logits.float(), self.seen[rows], self.penalty[rows])
        block_eos = (frames < 2) | self.ignore_eos[rows]
        logits = logits.masked_fill(self.suppressed | (block_eos[:, None] & self.is_eos), float("-inf"))
        params = RowParams(self.main.temperature[rows], self.main.top_k[rows], self.main.top_p[rows], self.main.seeds[rows])
        code = sample(logits, params, frames, group=0)
        self.seen[rows].scatter_(1, code[:, None], True)
        return code

    # -- steps ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, requests: list[Request], first_row: int) -> None:
        """Run the prompts of new requests into rows first_row.. and draw their first codebook-0 token."""
        count = len(requests)
        rows = slice(first_row, first_row + count)
        lengths = [len(r.prompt.text_ids) for r in requests]
        longest = max(lengths)
        text = torch.zeros(count, longest, dtype=torch.long)
        codec = torch.full((count, longest), NO_CODEC, dtype=torch.long)
        for i, request in enumerate(requests):
            text[i, : lengths[i]] = torch.tensor(request.prompt.text_ids)
            codec[i, : lengths[i]] = torch.tensor(request.prompt.codec_ids)
        text, codec = text.to(self.device), codec.to(self.device)
        positions = torch.arange(longest, device=self.device).expand(count, longest)
        embeds = self.talker.prompt_embeds(text, codec)
        cache = StaticKV(self.cache.keys[:, rows], self.cache.values[:, rows])
        hidden = self.talker(embeds, positions, cache, longest)
        last = hidden[torch.arange(count, device=self.device), torch.tensor(lengths, device=self.device) - 1]
        self._set_params(rows, requests)
        self.seen[rows] = False
        self.frame_index[rows] = 0
        self.position[rows] = torch.tensor(lengths, device=self.device)
        self.past_hidden[rows] = last
        self.last_code[rows] = self._sample_first_codebook(self.talker.codec_head(last), rows, self.frame_index[rows])

    def set_buckets(self, batch_sizes: list[int], spans: list[int]) -> None:
        """Pad steps to these batch sizes and attention spans (needed for graphs, allowed without)."""
        self.batch_buckets = sorted(b for b in set(batch_sizes) if b <= self.max_rows)
        self.span_buckets = sorted(s for s in set(spans) if s <= self.max_positions)

    @staticmethod
    def _bucket(value: int, buckets: list[int]) -> int:
        return next((b for b in buckets if b >= value), value)

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: list[int], spans: list[int]) -> None:
        """Capture the frame step for every (batch, span) bucket. Run before any request is admitted."""
        self.set_buckets(batch_sizes, spans)
        pool = None
        for span in reversed(self.span_buckets):  # largest first: later graphs reuse its memory pool
            for batch in reversed(self.batch_buckets):
                self._reset_rows(slice(0, batch))
                for _ in range(2):  # warm up kernels and autotuning outside the capture
                    self._decode_into_output(batch, span)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream(self.device)):
                    self._decode_into_output(batch, span)
                pool = graph.pool()
                self.graphs[(batch, span)] = graph
        self._reset_rows(slice(0, self.max_rows))
        torch.cuda.synchronize(self.device)

    def _reset_rows(self, rows: slice) -> None:
        """Put rows that no request uses back in a harmless state (positions inside the cache)."""
        self.position[rows] = 0
        self.frame_index[rows] = 0

    @torch.inference_mode()
    def decode(self, batch: int, span: int) -> torch.Tensor:
        """One frame for rows 0..batch-1: returns [batch, 17] = the frame's 16 codes + next codebook-0 token.

        span: attention length, at least every row's position + 1. Both are padded to their buckets;
        padding rows compute throw-away frames.
        """
        padded, span = self._bucket(batch, self.batch_buckets), self._bucket(span, self.span_buckets)
        if padded > batch:
            self._reset_rows(slice(batch, padded))
        graph = self.graphs.get((padded, span))
        if graph is not None:
            graph.replay()
        else:
            self._decode_into_output(padded, span)
        return self.step_output[:batch]

    def _decode_into_output(self, batch: int, span: int) -> None:
        rows = slice(0, batch)
        frames = self.frame_index[rows].clone()
        talker = self.talker
        sub = RowParams(self.sub.temperature[rows], self.sub.top_k[rows], self.sub.top_p[rows], self.sub.seeds[rows])
        residual = talker.code_predictor.predict_frame(
            self.past_hidden[rows], talker.model.codec_embedding(self.last_code[rows]),
            self.predictor_keys, self.predictor_values, lambda logits, group: sample(logits, sub, frames, group))
        frame = torch.cat((self.last_code[rows, None], residual), dim=1)
        text = self.trailing[rows].gather(1, frames.clamp(max=self.max_text_tokens)[:, None])[:, 0]
        embeds = (talker.frame_embeds(frame) + talker.text_embeds(text))[:, None]
        hidden = talker(embeds, self.position[rows, None], self.cache, span)[:, 0]
        self.frame_index[rows] += 1
        self.position[rows] += 1
        self.past_hidden[rows] = hidden
        self.last_code[rows] = self._sample_first_codebook(talker.codec_head(hidden), rows, self.frame_index[rows])
        self.step_output[rows, :-1] = frame
        self.step_output[rows, -1] = self.last_code[rows]
