"""Qwen3-TTS's frame runner: the talker, its KV cache, every running request's row state, CUDA graphs.

The frame step (15 code-predictor steps with sampling, the talker step, codebook-0 sampling) is one
CUDA graph per (batch bucket, attention-span bucket), as `FrameRunner` describes; so are padded
prefills and the writes of admitted rows. Nothing here branches on a request in Python; the host
learns one [B, 17] array per frame step: the frame's 16 codes and the next codebook-0 token, whose
value `end_marker` (end of speech) ends the request.
"""

from __future__ import annotations

import torch

from ..models.config import Qwen3TTSConfig
from ..models.fp8 import check_fp8_device
from ..models.layers import StaticKV
from ..models.talker import Qwen3TTSBackbone
from .admission import AdmissionInputs
from .frame_runner import FrameRunner
from .request import Request
from .row_state import RowState
from .sampling import apply_repetition_penalty, noise_keys, sample

# An `fp8_kv_cache` value -> (the talker's cache in FP8, the code predictor's cache in FP8)
FP8_KV_CACHES = {"off": (False, False), "talker": (True, False), "on": (True, True)}


class ModelRunner(FrameRunner):
    early_first_frames = True

    def __init__(
        self,
        model: Qwen3TTSBackbone,
        max_rows: int,
        max_positions: int,
        max_text_tokens: int,
        prefill_stream: torch.cuda.Stream | None = None,
        fp8_kv_cache: str = "off",
    ):
        """prefill_stream: where padded prefills run, beside the frame step in flight (see
        `_beside_the_step`); None: on the caller's stream, between steps. fp8_kv_cache: which caches
        hold FP8 keys and values (`StaticKV`): none (off), the talker's, or the code predictor's too (on)."""
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
        self.end_marker, self.pad_text_id = config.talker.codec_eos_id, config.tts_pad_token_id
        t, p = config.talker.transformer, config.talker.predictor
        talker_fp8, predictor_fp8 = FP8_KV_CACHES[fp8_kv_cache]
        if talker_fp8:
            check_fp8_device(self.device, "fp8_kv_cache", "FP8 keys and values")
        self.cache = StaticKV.allocate(
            (t.num_layers, max_rows, t.num_kv_heads, max_positions, t.head_dim),
            self.device,
            self.dtype,
            talker_fp8,
        )
        predictor_length = talker.code_predictor.cache_length
        # Every position here is below the cache's length, so rotary embeddings can be lookups.
        talker.model.rotary.tabulate(max_positions, self.dtype)
        talker.code_predictor.model.rotary.tabulate(predictor_length, self.dtype)
        self.predictor_cache = StaticKV.allocate(
            (p.num_layers, max_rows, p.num_kv_heads, predictor_length, p.head_dim),
            self.device,
            self.dtype,
            predictor_fp8,
        )
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

    def _extra_embeds(self, requests: list[Request], length: int) -> torch.Tensor | None:
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

    def _write_admitted(
        self, inputs: AdmissionInputs, last_hidden: torch.Tensor, scratch_length: int | None
    ) -> None:
        """Write admitted requests' rows: their scalars and trailing text, their prompts' KV entries
        when prefilled into the scratch cache (`scratch_length` positions of it), the prompts' last
        hidden states and the first codebook-0 tokens. The rows follow the uploaded first row, so one
        graph per (requests, length bucket) serves admissions into any rows."""
        state, rows = self.state, self._admit_rows(inputs, scratch_length)
        last = last_hidden[: len(rows)]
        state.past_hidden.index_copy_(0, rows, last)
        frames = state.frame_index[rows]
        keys = noise_keys(state.main.seeds[rows], frames[:, None], self.code_groups[:1])[:, 0]
        state.last_code.index_copy_(
            0, rows, self._sample_first_codebook(self.talker.codec_head(last), rows, frames, keys)
        )

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

    @property
    def trailing_width(self) -> int:
        return self.state.trailing.shape[1]

    def set_buckets(
        self,
        batch_sizes: list[int],
        spans: list[int],
        prefill_batch_sizes: list[int] = (),
        prefill_lengths: list[int] = (),
    ) -> None:
        super().set_buckets(batch_sizes, spans, prefill_batch_sizes, prefill_lengths)
        if self.prefill_length_buckets:
            # What cloned voices add to their prompts' embeddings (x-vectors, reference frames): zeros
            # except during a cloned voice's prefill (`_prefill_padded_group`).
            batch, length = self.prefill_batch_buckets[-1], self.prefill_length_buckets[-1]
            hidden = self.config.talker.transformer.hidden_size
            self.prefill_extra = torch.zeros(batch, length, hidden, device=self.device, dtype=self.dtype)

    def _decode_into_output(self, batch: int, span: int) -> None:
        self._complete_frame_into_output(batch)
        self._advance_into_output(batch, span)

    def _complete_frame_into_output(self, batch: int) -> None:
        """The frame step's first part: codebooks 1..15 of each row's frame (the code predictor), the
        whole frame into `step_output[:, :-1]`. A first frame is never its request's last (the
        official minimum of two frames), so it can go to the host now (`early_first_frames`)."""
        rows, state, talker = slice(0, batch), self.state, self.talker
        groups = self.code_groups  # group 0's key is unused here: it starts the next frame
        keys = noise_keys(state.main.seeds[rows], state.frame_index[rows, None], groups)
        sub = state.sub[rows]
        residual = talker.code_predictor.predict_frame(
            state.past_hidden[rows],
            talker.model.codec_embedding(state.last_code[rows]),
            self.predictor_cache,
            lambda logits, group: sample(logits, sub, keys[:, group]),
        )
        self.step_output[rows, :-1] = torch.cat((state.last_code[rows, None], residual), dim=1)

    def _advance_into_output(self, batch: int, span: int) -> None:
        """The frame step's second part: the talker over each row's frame, and the next frame's
        codebook 0 into `step_output[:, -1]` (end of speech ends the request)."""
        rows, state, talker = slice(0, batch), self.state, self.talker
        frames = state.frame_index[rows].clone()
        hold = state.hold[rows].clone()
        frame = self.step_output[rows, :-1]
        key = noise_keys(state.main.seeds[rows], frames[:, None] + 1, self.code_groups[:1])[:, 0]
        text = state.trailing[rows].gather(1, frames.clamp(max=self.max_text_tokens)[:, None])[:, 0]
        embeds = (talker.frame_embeds(frame) + talker.text_embeds(text))[:, None]
        # A held row writes its KV entry at its next position too: its next real frame overwrites it.
        hidden = talker(embeds, state.position[rows, None], self.cache, span)[:, 0]
        advance = (~hold).long()
        state.frame_index[rows] += advance
        state.position[rows] += advance
        state.past_hidden[rows] = torch.where(hold[:, None], state.past_hidden[rows], hidden)
        logits = talker.codec_head(hidden)
        code = self._sample_first_codebook(logits, rows, state.frame_index[rows], key, hold)
        state.last_code[rows] = torch.where(hold, state.last_code[rows], code)
        self.step_output[rows, -1] = state.last_code[rows]
