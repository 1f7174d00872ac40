"""CSM's frame runner: the backbone, its KV cache, the depth decoder's scratch and every row's state.

A row holds one complete frame ahead. The prefill runs the prompt, samples codebook 0 and runs the
depth decoder: frame 0. A frame step feeds the held frame t to the backbone, samples codebook 0 of
frame t+1 and runs the depth decoder over its other codebooks, and returns frame t with, in the last
column, whether frame t+1 is the end frame (transformers' rule, `ModelFamily.is_end`). So the end
frame, which is not audio, is never returned, and the frame before it is returned as the last one,
as transformers' generate cuts its audio. The whole step is one CUDA graph per (batch, span) bucket;
padded prefills and the admitted rows' writes (the first frame's depth decoder included) are graphs
per (batch, length) and (requests, length) bucket, as `FrameRunner` describes.

A prompt with a context turn (`CsmPrompt.context_codes`) embeds its audio positions as frames: the
prefill's extra-embedding buffer holds those frames' embeddings, which replace the text embeddings
at the <|AUDIO|> and <|audio_eos|> positions (zeros, and no such position, in every other prompt).

Sampling is the engine's (`sampling`): seeded per row, greedy at temperature 0. Codes the codec
cannot decode (the specials above Mimi's codebook) are never drawn; the repetition penalty applies to
codebook 0 over the codes a row drew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.csm.model import CsmModel
from ..models.csm.prompt import CsmPrompt
from ..models.layers import StaticKV
from .admission import AdmissionInputs
from .frame_runner import FrameRunner
from .request import Request
from .row_state import Rows
from .sampling import apply_repetition_penalty, noise_keys, sample


@dataclass(frozen=True, eq=False)
class CsmRows(Rows):
    """CSM's rows (the `Rows` fields first)."""

    frame: torch.Tensor  # [R, K] int64: the complete frame the next step feeds back and returns


class CsmRunner(FrameRunner):
    end_marker = 1  # the last column: the next frame is the end frame
    empty_end_marker = 2  # the frame fed is itself the end: only a request's first (made at admission)
    pad_text_id = 0  # CSM feeds no text per frame: an admission's trailing text is unused

    def __init__(
        self,
        model: CsmModel,
        is_end: Callable[[torch.Tensor], torch.Tensor],
        max_rows: int,
        max_positions: int,
        max_text_tokens: int,
        prefill_stream: torch.cuda.Stream | None = None,
    ):
        """is_end: the family's end rule; prefill_stream: where padded prefills run, beside the frame
        step in flight; None: on the caller's stream, between steps."""
        config = model.config
        param = model.lm_head.weight
        super().__init__(
            param.device,
            param.dtype,
            max_rows,
            max_positions,
            max_text_tokens,
            config.num_codebooks,
            prefill_stream,
        )
        self.model, self.config, self.is_end = model, config, is_end
        self.extra_width = config.backbone.hidden_size  # context turns' frame embeddings
        self.cache, (self.depth_keys, self.depth_values) = model.new_caches(max_rows, max_positions)
        # Every position here is below the cache's length, so rotary embeddings can be lookups.
        model.backbone_model.rotary.tabulate(max_positions, self.dtype)
        model.depth_decoder.model.rotary.tabulate(model.depth_decoder.cache_length, self.dtype)
        self.state = CsmRows.allocate_with(
            max_rows,
            config.vocab_size,
            self.device,
            frame=torch.zeros(max_rows, config.num_codebooks, device=self.device, dtype=torch.long),
        )
        self.codebook_ids = torch.arange(config.num_codebooks, device=self.device)
        self.true = torch.ones((), dtype=torch.bool, device=self.device)
        self.undecodable = torch.arange(config.vocab_size, device=self.device) >= config.codec.codebook_size

    # -- sampling --------------------------------------------------------------------------------

    def _complete_frame(
        self, hidden: torch.Tensor, logits: torch.Tensor, rows: slice | torch.Tensor
    ) -> torch.Tensor:
        """The next frame [B, K] of `rows` (the batch's slice, or admitted rows' indices) from the
        backbone's last state [B, D] and its codebook-0 logits [B, vocab]: codebook 0 (penalised,
        sampled), then the depth decoder's codebooks."""
        state = self.state
        keys = noise_keys(state.main.seeds[rows], state.frame_index[rows, None], self.codebook_ids)
        logits = apply_repetition_penalty(logits.float(), state.seen[rows], state.penalty[rows])
        first = sample(logits.masked_fill(self.undecodable, float("-inf")), state.main[rows], keys[:, 0])
        if isinstance(rows, slice):
            state.seen[rows].scatter_(1, first[:, None], True)
        else:  # indexing by a tensor reads a copy: write through the indices
            state.seen.index_put_((rows, first), self.true)
        sub = state.sub[rows]

        def draw(depth_logits: torch.Tensor, codebook: int) -> torch.Tensor:
            return sample(depth_logits.masked_fill(self.undecodable, float("-inf")), sub, keys[:, codebook])

        rest = self.model.depth_decoder.predict_frame(hidden, first, self.depth_keys, self.depth_values, draw)
        state.frame_index[rows] += 1
        return torch.cat((first[:, None], rest), dim=1)

    # -- steps ----------------------------------------------------------------------------------

    def _extra_embeds(self, requests: list[Request], length: int) -> torch.Tensor | None:
        """Context turns' frame embeddings at their audio positions [count, length, D], or None when no
        prompt has a context turn."""
        prompts: list[CsmPrompt] = [r.prompt for r in requests]
        if all(p.context_codes is None for p in prompts):
            return None
        extra = torch.zeros(
            len(prompts), length, self.config.backbone.hidden_size, device=self.device, dtype=self.dtype
        )
        for row, prompt in enumerate(prompts):
            if prompt.context_codes is not None:
                start, codes = prompt.context_position, self._upload(torch.from_numpy(prompt.context_codes))
                extra[row, start : start + len(codes)] = self.model.frame_embeds(codes)
        return extra

    def _prompt_last_hidden(
        self,
        text: torch.Tensor,
        codec: torch.Tensor,
        last_index: torch.Tensor,
        cache: StaticKV,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompts [B, L] into `cache` (CSM prompts hold no codec ids; `extra` [B, L, D]: context
        frames' embeddings, which replace the audio positions' text embeddings); returns each
        prompt's final hidden state [B, D]. A padded prompt's tail is never seen by its real
        positions (causal attention)."""
        batch, length = text.shape
        positions = torch.arange(length, device=self.device).expand(batch, length)
        embeds = self.model.text_embeds(text)
        if extra is not None:
            cfg = self.config
            audio = (text == cfg.audio_token_id) | (text == cfg.audio_eos_token_id)
            embeds = torch.where(audio[..., None], extra, embeds)
        hidden = self.model.backbone_model(embeds, positions, cache.bind(positions, length))
        return hidden[torch.arange(batch, device=self.device), last_index]

    def _write_admitted(
        self, inputs: AdmissionInputs, last_hidden: torch.Tensor, scratch_length: int | None
    ) -> None:
        """Write admitted requests' rows (`FrameRunner._write_admitted`) and complete their first
        frames: codebook 0 from the prompt's last state, then the depth decoder."""
        state, rows = self.state, self._admit_rows(inputs, scratch_length)
        last = last_hidden[: len(rows)]
        state.frame.index_copy_(0, rows, self._complete_frame(last, self.model.lm_head(last), rows))

    def _decode_into_output(self, batch: int, span: int) -> None:
        rows, state = slice(0, batch), self.state
        fed = state.frame[rows].clone()
        hidden, logits = self.model(
            self.model.frame_embeds(fed)[:, None], state.position[rows, None], self.cache, span
        )
        state.position[rows] += 1
        frame = self._complete_frame(hidden[:, -1], logits, rows)
        state.frame[rows] = frame
        self.step_output[rows, :-1] = fed
        # A fed frame after the first was the step before's `frame`, whose end ended its request.
        ends = ~state.ignore_eos[rows]
        marker = (self.is_end(frame) & ends).long()
        self.step_output[rows, -1] = torch.where(self.is_end(fed) & ends, self.empty_end_marker, marker)
