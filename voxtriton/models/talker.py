"""The Qwen3-TTS backbone: the talker (codebook 0) and the code predictor (codebooks 1..15).

Module names mirror the official checkpoint (`talker.model.layers.0...`), so loading is a
name-for-name copy apart from the fused projections. Nothing here loops over requests or owns a
cache: every method takes a batch and the caller's KV storage, which is what lets the engine batch
requests of different lengths and capture the per-frame work in CUDA graphs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3TTSConfig, TalkerConfig
from .layers import DecoderStack, Linear, StaticKV

# sample(logits [B, V], codebook index) -> token ids [B]
Sampler = Callable[[torch.Tensor, int], torch.Tensor]


class TextProjection(nn.Module):
    """Maps text-token embeddings (text_hidden_size) into the talker's hidden size."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.transformer)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.transformer.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class PredictorModel(DecoderStack):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.predictor)
        # Embeddings of codebooks 1..15 live in the talker's hidden size (they are summed into the
        # talker input); the predictor reads them through small_to_mtp_projection.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.predictor_vocab_size, cfg.transformer.hidden_size)
            for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    """Predicts codebooks 1..15 of a frame from the talker's hidden state and codebook 0."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.num_residual = cfg.num_code_groups - 1
        self.model = PredictorModel(cfg)
        self.lm_head = nn.ModuleList(
            Linear(cfg.predictor.hidden_size, cfg.predictor_vocab_size, bias=False)
            for _ in range(self.num_residual)
        )
        if cfg.predictor.hidden_size != cfg.transformer.hidden_size:
            self.small_to_mtp_projection = Linear(
                cfg.transformer.hidden_size, cfg.predictor.hidden_size, bias=True
            )
        else:
            self.small_to_mtp_projection = nn.Identity()

    @property
    def cache_length(self) -> int:
        """Positions per frame: the talker state, codebook 0, then codebooks 1..14 fed back."""
        return self.num_residual + 1

    def forward(self, embeds, positions, kv: StaticKV):
        return self.model(self.small_to_mtp_projection(embeds), positions, kv)

    def predict_frame(
        self,
        talker_hidden: torch.Tensor,
        first_code_embed: torch.Tensor,
        cache: StaticKV,
        sample: Sampler,
    ) -> torch.Tensor:
        """Codebooks 1..15 for a batch: [B, 15] ids.

        talker_hidden, first_code_embed: [B, D]. cache: [layers, >=B, kv_heads, cache_length, head_dim]
        scratch storage, overwritten every frame (positions restart at 0).
        """
        batch = talker_hidden.shape[0]
        device = talker_hidden.device
        span = self.cache_length
        positions = torch.arange(2, device=device).expand(batch, 2)
        embeds = torch.stack((talker_hidden, first_code_embed), dim=1)
        hidden = self(embeds, positions, cache.bind(positions, span))[:, -1]
        codes = []
        for group in range(self.num_residual):
            code = sample(self.lm_head[group](hidden), group + 1)
            codes.append(code)
            if group + 1 == self.num_residual:
                break
            positions = torch.full((batch, 1), group + 2, device=device, dtype=torch.long)
            embed = self.model.codec_embedding[group](code)[:, None]
            hidden = self(embed, positions, cache.bind(positions, span))[:, -1]
        return torch.stack(codes, dim=1)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.config = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.transformer.hidden_size)
        self.codec_head = Linear(cfg.transformer.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)

    def text_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.model.text_embedding(text_ids))

    def prompt_embeds(self, text_ids: torch.Tensor, codec_ids: torch.Tensor) -> torch.Tensor:
        """Prompt positions carry a text token plus, where codec_ids >= 0, a codec token."""
        codec = self.model.codec_embedding(codec_ids.clamp(min=0)) * (codec_ids >= 0)[..., None]
        return self.text_embeds(text_ids) + codec

    def frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of a frame [B, 16] -> [B, D]: the next talker input."""
        parts = [self.model.codec_embedding(codes[:, 0])]
        parts += [table(codes[:, i + 1]) for i, table in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(parts, dim=1).sum(dim=1)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: StaticKV, span: int
    ) -> torch.Tensor:
        """Advance a batch: embeds [B, T, D] at positions [B, T]; returns final hidden [B, T, D]."""
        return self.model(embeds, positions, cache.bind(positions, span))


class Qwen3TTSBackbone(nn.Module):
    """Root module so parameter names match the checkpoint's `talker.*` prefix."""

    def __init__(self, config: Qwen3TTSConfig):
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker)
