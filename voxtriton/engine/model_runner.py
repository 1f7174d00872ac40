"""Qwen3-TTS's frame runner: the talker, its KV cache, every running request's row state, CUDA graphs.

The frame step (15 code-predictor steps with sampling, the talker step, codebook-0 sampling) is one
CUDA graph per (batch bucket, attention-span bucket), as `FrameRunner` describes; so are padded
prefills and the writes of admitted rows. Nothing here branches on a request in Python; the host
learns one [B, 17] array per frame step: the frame's 16 codes and the next codebook-0 token, whose
value `end_marker` (end of speech) ends the request.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..models.config import Qwen3TTSConfig
from ..models.layers import StaticKV
from ..models.talker import Qwen3TTSBackbone
from .admission import AdmissionInputs, AdmissionLayout
from .codec_runner import capture_stream
from .frame_runner import FrameRunner
from .request import Request
from .row_state import RowState
from .sampling import apply_repetition_penalty, noise_keys, sample

NO_CODEC = -1


class ModelRunner(FrameRunner):
    def __init__(
        self,
        model: Qwen3TTSBackbone,
        max_rows: int,
        max_positions: int,
        max_text_tokens: int,
        prefill_stream: torch.cuda.Stream | None = None,
    ):
        """prefill_stream: where padded prefills run, beside the frame step in flight (see
        `_beside_the_step`); None: on the caller's stream, between steps."""
        config: Qwen3TTSConfig = model.config
        self.model, self.config = model, config
        talker = model.talker
        self.talker = talker
        param = talker.codec_head.weight
        super().__init__(
            param.device,
            param.dtype,
            max_rows,
            max_positions,
            max_text_tokens,
            config.talker.num_code_groups,
            prefill_stream,
        )
        self.end_marker = config.talker.codec_eos_id
        t, p = config.talker.transformer, config.talker.predictor

        def zeros(*shape, dtype=None):
            return torch.zeros(*shape, device=self.device, dtype=dtype or self.dtype)

        self.cache = StaticKV(
            zeros(t.num_layers, max_rows, t.num_kv_heads, max_positions, t.head_dim),
            zeros(t.num_layers, max_rows, t.num_kv_heads, max_positions, t.head_dim),
        )
        predictor_length = talker.code_predictor.cache_length
        # Every position here is below the cache's length, so rotary embeddings can be lookups.
        talker.model.rotary.tabulate(max_positions, self.dtype)
        talker.code_predictor.model.rotary.tabulate(predictor_length, self.dtype)
        self.predictor_keys = zeros(p.num_layers, max_rows, p.num_kv_heads, predictor_length, p.head_dim)
        self.predictor_values = torch.zeros_like(self.predictor_keys)
        vocab = config.talker.vocab_size
        self.state = RowState.allocate(
            max_rows,
            hidden_size=t.hidden_size,
            vocab=vocab,
            trailing_width=max_text_tokens + 1,
            pad_text_id=config.tts_pad_token_id,
            device=self.device,
            dtype=self.dtype,
        )
        self.true = torch.ones((), dtype=torch.bool, device=self.device)
        # Codebook-0 tokens the official generation never samples: the control ids above the
        # codec codebook, except end-of-speech.
        eos = config.talker.codec_eos_id
        self.suppressed = torch.arange(vocab, device=self.device) >= vocab - 1024
        self.suppressed[eos] = False
        self.is_eos = torch.arange(vocab, device=self.device) == eos
        self.code_groups = torch.arange(config.talker.num_code_groups, device=self.device)
        self.prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Writing admitted requests' rows, per (requests, prompt-length bucket): see `_write_admitted`.
        self.admission_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.set_buckets([], [])

    # -- rows ----------------------------------------------------------------------------------

    def write_text(self, rows: list[int], columns: list[int], ids: list[int]) -> None:
        """Text that reached running requests (input streaming): `ids[i]` into row `rows[i]`'s trailing
        text at `columns[i]`, in one upload."""
        host = torch.tensor([rows, columns, ids], dtype=torch.long)
        where = self._upload(host)
        self.state.trailing.index_put_((where[0], where[1]), where[2])

    def set_holds(self, holds: list[bool]) -> None:
        """Which of rows 0..len(holds)-1 wait for text: a frame step leaves their state unchanged."""
        self.state.hold[: len(holds)].copy_(self._upload(torch.tensor(holds, dtype=torch.bool)))

    # -- codebook 0 --------------------------------------------------------------------------------

    def _sample_first_codebook(
        self,
        logits: torch.Tensor,
        rows: slice | torch.Tensor,
        frames: torch.Tensor,
        keys: torch.Tensor,
        hold: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Penalties, suppression and the official minimum of two frames, then sampling. rows: the
        batch's (a slice) or admitted ones (row indices). Rows whose `hold` is set keep what they saw."""
        state = self.state
        logits = apply_repetition_penalty(logits.float(), state.seen[rows], state.penalty[rows])
        block_eos = (frames < 2) | state.ignore_eos[rows]
        logits = logits.masked_fill(self.suppressed | (block_eos[:, None] & self.is_eos), float("-inf"))
        code = sample(logits, state.main[rows], keys)
        if isinstance(rows, slice):
            state.seen[rows].scatter_(
                1, code[:, None], ~hold[:, None] | state.seen[rows].gather(1, code[:, None])
            )
        else:  # indexing by a tensor reads a copy: write through the indices
            state.seen.index_put_((rows, code), self.true)
        return code

    # -- steps ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, requests: list[Request], first_row: int) -> None:
        """Run the prompts of new requests into rows first_row.. and draw their first codebook-0 token.

        Admissions larger than the largest prefill batch bucket go in groups of that size.
        """
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
            layout = AdmissionLayout(count, self.state.trailing.shape[1])
            flat = self._upload(torch.from_numpy(self._pack(layout, requests, first_row, count, longest)))
            inputs = layout.views(flat, count, count, longest)
            rows = slice(first_row, first_row + count)
            last = self._prompt_last_hidden(
                inputs.text,
                inputs.codec,
                inputs.last_index,
                StaticKV(self.cache.keys[:, rows], self.cache.values[:, rows]),
                self._cloned_voice_embeds(requests, longest),
            )
            self._write_admitted(inputs, last, None)

    def _cloned_voice_embeds(self, requests: list[Request], length: int) -> torch.Tensor | None:
        """What cloned voices add to their prompts' embeddings [count, length, D] (x-vectors and
        reference frames), or None when no prompt has a cloned voice."""
        if all(r.prompt.speaker_embedding is None for r in requests):
            return None
        extra = torch.zeros(len(requests), length, self.talker.config.transformer.hidden_size)
        extra = extra.to(self.device, self.dtype)
        for row, request in enumerate(requests):
            prompt = request.prompt
            if prompt.speaker_embedding is not None:
                vector = torch.from_numpy(prompt.speaker_embedding)
                extra[row, prompt.speaker_position] = vector.to(self.device, self.dtype)
            if prompt.reference_codes is not None:
                codes = torch.from_numpy(prompt.reference_codes).to(self.device)
                start = prompt.reference_position
                extra[row, start : start + len(codes)] = self.talker.frame_embeds(codes)
        return extra

    def _prefill_padded_group(self, requests: list[Request], first_row: int, batch: int, length: int) -> None:
        """Prompts padded to a prefill bucket: one upload into the admission buffer, the prefill (beside
        the step in flight) into the scratch cache, then the rows written: two graph replays on a GPU.
        Cloned voices' embeddings go into the prefill's extra-embedding buffer for this prefill only,
        so the buffer holds zeros for every other admission."""
        count = len(requests)
        host = torch.from_numpy(self._pack(self.admission_layout, requests, first_row, batch, length))
        with self._beside_the_step():
            self.admission[: host.numel()].copy_(self._upload(host))
            longest = max(len(r.prompt.text_ids) for r in requests)
            cloned = self._cloned_voice_embeds(requests, longest)
            if cloned is not None:
                self.prefill_extra[:count, :longest].copy_(cloned)
            entry = self.prefill_graphs.get((batch, length))
            if entry is not None:
                entry[0].replay()
                last = entry[1]
            else:
                last = self._prefill_padded(batch, length)
            if cloned is not None:
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
        return layout.pack(requests, first_row, batch, length, self.config.tts_pad_token_id, NO_CODEC)

    def _admission_inputs(self, count: int, batch: int, length: int) -> AdmissionInputs:
        return self.admission_layout.views(self.admission, count, batch, length)

    def _write_admitted(
        self, inputs: AdmissionInputs, last_hidden: torch.Tensor, scratch_length: int | None
    ) -> None:
        """Write admitted requests' rows: their scalars and trailing text, their prompts' KV entries
        when prefilled into the scratch cache (`scratch_length` positions of it), the prompts' last
        hidden states and the first codebook-0 tokens. The rows follow the uploaded first row, so one
        graph per (requests, length bucket) serves admissions into any rows."""
        count, state = inputs.scalars.shape[0], self.state
        rows = inputs.first_row + self.row_offsets[:count]
        state.admit(rows, inputs)
        if scratch_length is not None:
            # Padding positions beyond a prompt are overwritten by its frames before any step reads them.
            for cache, scratch in (
                (self.cache.keys, self.prefill_kv.keys),
                (self.cache.values, self.prefill_kv.values),
            ):
                cache[:, :, :, :scratch_length].index_copy_(1, rows, scratch[:, :count, :, :scratch_length])
        last = last_hidden[:count]
        state.past_hidden.index_copy_(0, rows, last)
        frames = state.frame_index[rows]
        keys = noise_keys(state.main.seeds[rows], frames[:, None], self.code_groups[:1])[:, 0]
        state.last_code.index_copy_(
            0, rows, self._sample_first_codebook(self.talker.codec_head(last), rows, frames, keys)
        )

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

    def _prompt_last_hidden(
        self,
        text: torch.Tensor,
        codec: torch.Tensor,
        last_index: torch.Tensor,
        cache: StaticKV,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompts [B, L] (plus `extra` embeddings [B, L, D]) into `cache`; returns each prompt's final
        hidden state [B, D]."""
        batch, length = text.shape
        positions = torch.arange(length, device=self.device).expand(batch, length)
        embeds = self.talker.prompt_embeds(text, codec)
        if extra is not None:
            embeds = embeds + extra
        hidden = self.talker(embeds, positions, cache, length)
        return hidden[torch.arange(batch, device=self.device), last_index]

    def _prefill_padded(self, batch: int, length: int) -> torch.Tensor:
        """The prefill of one (batch, length) bucket from the admission buffer into the scratch cache
        (what its graph replays)."""
        cache = StaticKV(self.prefill_kv.keys[:, :batch], self.prefill_kv.values[:, :batch])
        inputs = self._admission_inputs(batch, batch, length)
        extra = self.prefill_extra[:batch, :length]
        return self._prompt_last_hidden(inputs.text, inputs.codec, inputs.last_index, cache, extra)

    def set_buckets(
        self,
        batch_sizes: list[int],
        spans: list[int],
        prefill_batch_sizes: list[int] = (),
        prefill_lengths: list[int] = (),
    ) -> None:
        """Pad steps to these batch sizes and attention spans, and prompts to these prefill batch sizes
        and lengths (needed for graphs, allowed without)."""
        super().set_buckets(batch_sizes, spans)
        self.prefill_batch_buckets = sorted(b for b in set(prefill_batch_sizes) if b <= self.max_rows)
        self.prefill_length_buckets = sorted(n for n in set(prefill_lengths) if n <= self.max_positions)
        if self.prefill_batch_buckets and self.prefill_length_buckets:
            batch, length = self.prefill_batch_buckets[-1], self.prefill_length_buckets[-1]
            t = self.config.talker.transformer

            def scratch():
                return torch.zeros(
                    t.num_layers,
                    batch,
                    t.num_kv_heads,
                    length,
                    t.head_dim,
                    device=self.device,
                    dtype=self.dtype,
                )

            self.prefill_kv = StaticKV(scratch(), scratch())
            self.admission_layout = AdmissionLayout(batch, self.state.trailing.shape[1])
            self.admission = torch.zeros(
                self.admission_layout.size(batch, length), device=self.device, dtype=torch.long
            )
            # What cloned voices add to their prompts' embeddings (x-vectors, reference frames): zeros
            # except during a cloned voice's prefill (`_prefill_padded_group`).
            self.prefill_extra = torch.zeros(
                batch, length, t.hidden_size, device=self.device, dtype=self.dtype
            )
        else:
            self.prefill_batch_buckets, self.prefill_length_buckets = [], []

    def graph_counts(self) -> dict[str, int]:
        return {
            **super().graph_counts(),
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
    ) -> None:
        """Capture the frame step for every (batch, span) bucket and the prefill for every (batch,
        length) bucket. Run before any request is admitted."""
        self.set_buckets(batch_sizes, spans, prefill_batch_sizes, prefill_lengths)
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

    def _decode_into_output(self, batch: int, span: int) -> None:
        rows, state = slice(0, batch), self.state
        frames = state.frame_index[rows].clone()
        hold = state.hold[rows].clone()
        talker = self.talker
        # Draw keys for the whole step at once: groups 1..15 complete this frame, group 0 starts the next.
        groups = self.code_groups
        keys = noise_keys(state.main.seeds[rows], frames[:, None] + (groups == 0), groups)
        sub = state.sub[rows]
        residual = talker.code_predictor.predict_frame(
            state.past_hidden[rows],
            talker.model.codec_embedding(state.last_code[rows]),
            self.predictor_keys,
            self.predictor_values,
            lambda logits, group: sample(logits, sub, keys[:, group]),
        )
        frame = torch.cat((state.last_code[rows, None], residual), dim=1)
        text = state.trailing[rows].gather(1, frames.clamp(max=self.max_text_tokens)[:, None])[:, 0]
        embeds = (talker.frame_embeds(frame) + talker.text_embeds(text))[:, None]
        # A held row writes its KV entry at its next position too: its next real frame overwrites it.
        hidden = talker(embeds, state.position[rows, None], self.cache, span)[:, 0]
        advance = (~hold).long()
        state.frame_index[rows] += advance
        state.position[rows] += advance
        state.past_hidden[rows] = torch.where(hold[:, None], state.past_hidden[rows], hidden)
        code = self._sample_first_codebook(
            talker.codec_head(hidden), rows, state.frame_index[rows], keys[:, 0], hold
        )
        state.last_code[rows] = torch.where(hold, state.last_code[rows], code)
        self.step_output[rows, :-1] = frame
        self.step_output[rows, -1] = state.last_code[rows]
