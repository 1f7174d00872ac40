"""CSM's frame runner: the backbone, its KV cache, the depth decoder's scratch and every row's state.

A row holds one complete frame ahead. The prefill runs the prompt, samples codebook 0 and runs the
depth decoder: frame 0. A frame step feeds the held frame t to the backbone, samples codebook 0 of
frame t+1 and runs the depth decoder over its other codebooks, and returns frame t with, in the last
column, whether frame t+1 is the end frame (transformers' rule, `ModelFamily.is_end`). So the end
frame, which is not audio, is never returned, and the frame before it is returned as the last one,
as transformers' generate cuts its audio. The whole step is one CUDA graph per (batch, span) bucket.

Sampling is the engine's (`sampling`): seeded per row, greedy at temperature 0. Codes the codec
cannot decode (the specials above Mimi's codebook) are never drawn; the repetition penalty applies to
codebook 0 over the codes a row drew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.csm.model import CsmModel
from ..models.layers import StaticKV
from .admission import AdmissionLayout
from .frame_runner import FrameRunner
from .request import Request
from .row_state import Rows
from .sampling import apply_repetition_penalty, noise_keys, sample

NO_CODEC = -1  # the admission layout's codec column: CSM prompts are text only
TEXT_PAD = 0  # a padded prompt's tail: causal attention never lets a real position see it


@dataclass(frozen=True, eq=False)
class CsmRows(Rows):
    """CSM's rows (the `Rows` fields first)."""

    frame: torch.Tensor  # [R, K] int64: the complete frame the next step feeds back and returns


class CsmRunner(FrameRunner):
    end_marker = 1  # the last column: the next frame is the end frame

    def __init__(
        self,
        model: CsmModel,
        is_end: Callable[[torch.Tensor], torch.Tensor],
        max_rows: int,
        max_positions: int,
        max_text_tokens: int,
        prefill_stream: torch.cuda.Stream | None = None,
    ):
        """is_end: the family's end rule. Prefills run eagerly on the caller's stream between steps, at
        their exact shapes (`prefill_stream` is accepted for the runner interface and not used)."""
        config = model.config
        param = model.lm_head.weight
        super().__init__(
            param.device, param.dtype, max_rows, max_positions, max_text_tokens, config.num_codebooks
        )
        self.model, self.config, self.is_end = model, config, is_end
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
        self.undecodable = torch.arange(config.vocab_size, device=self.device) >= config.codec.codebook_size

    # -- sampling --------------------------------------------------------------------------------

    def _complete_frame(self, hidden: torch.Tensor, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """The next frame [B, K] of `rows` from the backbone's last state [B, D] and its codebook-0
        logits [B, vocab]: codebook 0 (penalised, sampled), then the depth decoder's codebooks."""
        state = self.state
        keys = noise_keys(state.main.seeds[rows], state.frame_index[rows, None], self.codebook_ids)
        logits = apply_repetition_penalty(logits.float(), state.seen[rows], state.penalty[rows])
        first = sample(logits.masked_fill(self.undecodable, float("-inf")), state.main[rows], keys[:, 0])
        state.seen[rows].scatter_(1, first[:, None], True)
        sub = state.sub[rows]

        def draw(depth_logits: torch.Tensor, codebook: int) -> torch.Tensor:
            return sample(depth_logits.masked_fill(self.undecodable, float("-inf")), sub, keys[:, codebook])

        rest = self.model.depth_decoder.predict_frame(hidden, first, self.depth_keys, self.depth_values, draw)
        state.frame_index[rows] += 1
        return torch.cat((first[:, None], rest), dim=1)

    # -- steps ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, requests: list[Request], first_row: int) -> None:
        """Run the prompts of new requests into rows first_row.. and complete their first frames."""
        count, length = len(requests), max(len(r.prompt.text_ids) for r in requests)
        layout = AdmissionLayout(count, 1)
        flat = layout.pack(requests, first_row, count, length, TEXT_PAD, NO_CODEC)
        inputs = layout.views(self._upload(torch.from_numpy(flat)), count, count, length)
        rows, state = slice(first_row, first_row + count), self.state
        for index, column in enumerate(state.scalar_columns):
            column[rows] = inputs.scalars[:, index].to(column.dtype)
        state.seen[rows] = False
        state.frame_index[rows] = 0
        positions = torch.arange(length, device=self.device).expand(count, length)
        cache = StaticKV(self.cache.keys[:, rows], self.cache.values[:, rows])
        hidden = self.model.backbone_model(
            self.model.text_embeds(inputs.text), positions, cache.bind(positions, length)
        )
        last = hidden[torch.arange(count, device=self.device), inputs.last_index]
        state.frame[rows] = self._complete_frame(last, self.model.lm_head(last), rows)

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
        self.step_output[rows, -1] = (self.is_end(frame) & ~state.ignore_eos[rows]).long()

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: list[int], spans: list[int], **prefill_buckets) -> None:
        """Capture the frame step for every (batch, span) bucket and the row moves. Prefill buckets are
        accepted for the runner interface: CSM prefills run eagerly. Run before any admission."""
        self.set_buckets(batch_sizes, spans)
        initial_rows = [tensor.clone() for tensor in self.state.tensors]
        self._capture_steps()
        for tensor, initial in zip(self.state.tensors, initial_rows):
            tensor.copy_(initial)
        torch.cuda.synchronize(self.device)
