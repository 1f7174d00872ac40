"""CSM's two transformers: the backbone (one step per frame) and the depth decoder (31 steps per
frame), written for serving like the Qwen3-TTS talker: batched steps over a caller-owned static KV
cache, built from the shared layers in `models.layers`.

Module names mirror the official `model.safetensors` (`CsmForConditionalGeneration`), so the
loader maps tensors by name; q/k/v and gate/up are fused as everywhere else.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TransformerConfig
from ..layers import DecoderStack, Rotary, StaticKV
from ..talker import Sampler
from .config import CsmConfig, Llama3Rope


class Llama3Rotary(Rotary):
    """RoPE with Llama 3's frequency scaling: long wavelengths divided by `factor`, a smooth blend
    between the two thresholds, short wavelengths unchanged."""

    def __init__(self, head_dim: int, theta: float, scaling: Llama3Rope | None):
        object.__setattr__(self, "scaling", scaling)  # read by the base constructor
        super().__init__(head_dim, theta)

    def _inverse_frequencies(self, device) -> torch.Tensor:
        inverse = super()._inverse_frequencies(device)
        s = self.scaling
        if s is None:
            return inverse
        wavelength = 2 * math.pi / inverse
        low_threshold = s.original_max_positions / s.low_freq_factor
        high_threshold = s.original_max_positions / s.high_freq_factor
        scaled = torch.where(wavelength > low_threshold, inverse / s.factor, inverse)
        smooth = (s.original_max_positions / wavelength - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelength >= high_threshold) & (wavelength <= low_threshold)
        return torch.where(medium, blended, scaled)


class LlamaStack(DecoderStack):
    def __init__(self, cfg: TransformerConfig, rope: Llama3Rope | None):
        super().__init__(cfg)
        self.rotary = Llama3Rotary(cfg.head_dim, cfg.rope_theta, rope)


class AudioEmbeddings(nn.Module):
    """One table for all codebooks: codebook k's entry c is row k * vocab_size + c."""

    def __init__(self, codebooks: int, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.embed_audio_tokens = nn.Embedding(codebooks * vocab_size, hidden)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., K] -> the sum of the K codebook embeddings [..., hidden]."""
        offsets = torch.arange(codes.shape[-1], device=codes.device) * self.vocab_size
        return self.embed_audio_tokens(codes + offsets).sum(dim=-2)


class Backbone(LlamaStack):
    def __init__(self, config: CsmConfig):
        super().__init__(config.backbone, config.backbone_rope)
        self.embed_tokens = AudioEmbeddings(
            config.num_codebooks, config.vocab_size, config.backbone.hidden_size
        )


class DepthModel(LlamaStack):
    def __init__(self, config: CsmConfig):
        super().__init__(config.depth, config.depth_rope)
        # Codebook embeddings in the backbone's width (tied to the backbone's table in the checkpoint),
        # projected down with the backbone state.
        self.embed_tokens = nn.Embedding(
            config.num_codebooks * config.vocab_size, config.backbone.hidden_size
        )
        self.inputs_embeds_projector = nn.Linear(
            config.backbone.hidden_size, config.depth.hidden_size, bias=False
        )


class CodebooksHead(nn.Module):
    def __init__(self, hidden: int, codebooks: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(codebooks - 1, hidden, vocab_size))


class DepthDecoder(nn.Module):
    """Predicts codebooks 1..K-1 of a frame from the backbone's last state and codebook 0.

    Position 0 holds the backbone state, position p >= 1 the code of codebook p - 1; the state at
    position p gives codebook p through head p - 1."""

    def __init__(self, config: CsmConfig):
        super().__init__()
        self.num_codebooks, self.vocab_size = config.num_codebooks, config.vocab_size
        self.model = DepthModel(config)
        self.codebooks_head = CodebooksHead(config.depth.hidden_size, config.num_codebooks, config.vocab_size)

    @property
    def cache_length(self) -> int:
        return self.num_codebooks

    def code_embeds(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        return self.model.embed_tokens(codes + codebook * self.vocab_size)

    def step(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: StaticKV, codebook: int
    ) -> torch.Tensor:
        """embeds [B, T, backbone hidden] at positions [B, T] -> the logits of `codebook` [B, vocab]
        from the last position."""
        projected = self.model.inputs_embeds_projector(embeds)
        hidden = self.model(projected, positions, cache.bind(positions, self.cache_length))
        return hidden[:, -1] @ self.codebooks_head.weight[codebook - 1]

    def predict_frame(
        self,
        backbone_hidden: torch.Tensor,
        first_codes: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        sample: Sampler,
    ) -> torch.Tensor:
        """Codebooks 1..K-1 for a batch: [B, K-1] ids.

        backbone_hidden [B, D]; first_codes [B]. keys/values: [layers, >=B, kv_heads, cache_length,
        head_dim] scratch storage, overwritten every frame (positions restart at 0)."""
        batch, device = backbone_hidden.shape[0], backbone_hidden.device
        cache = StaticKV(keys, values)
        positions = torch.arange(2, device=device).expand(batch, 2)
        embeds = torch.stack((backbone_hidden, self.code_embeds(first_codes, 0)), dim=1)
        codes = []
        for codebook in range(1, self.num_codebooks):
            code = sample(self.step(embeds, positions, cache, codebook), codebook)
            codes.append(code)
            positions = torch.full((batch, 1), codebook + 1, device=device, dtype=torch.long)
            embeds = self.code_embeds(code, codebook)[:, None]
        return torch.stack(codes, dim=1)


class CsmModel(nn.Module):
    """Root module: parameter names match the checkpoint's (`backbone_model.*`, `depth_decoder.*`)."""

    def __init__(self, config: CsmConfig):
        super().__init__()
        self.config = config
        self.embed_text_tokens = nn.Embedding(config.text_vocab_size, config.backbone.hidden_size)
        self.backbone_model = Backbone(config)
        self.lm_head = nn.Linear(config.backbone.hidden_size, config.vocab_size, bias=False)
        self.depth_decoder = DepthDecoder(config)

    def text_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_text_tokens(text_ids)

    def frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """A frame's K codes [B, K] -> the next backbone input [B, D]."""
        return self.backbone_model.embed_tokens(codes)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: StaticKV, span: int):
        """Advance a batch: embeds [B, T, D] at positions [B, T] -> (final hidden [B, T, D],
        codebook-0 logits of the last position [B, vocab])."""
        hidden = self.backbone_model(embeds, positions, cache.bind(positions, span))
        return hidden, self.lm_head(hidden[:, -1])

    def new_caches(self, batch: int, length: int) -> tuple[StaticKV, tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed storage: the backbone's KV cache for `length` positions and the depth decoder's
        per-frame scratch (keys, values)."""
        param = self.lm_head.weight

        def storage(cfg: TransformerConfig, positions: int) -> torch.Tensor:
            shape = (cfg.num_layers, batch, cfg.num_kv_heads, positions, cfg.head_dim)
            return torch.zeros(shape, dtype=param.dtype, device=param.device)

        backbone = StaticKV(storage(self.config.backbone, length), storage(self.config.backbone, length))
        depth_length = self.depth_decoder.cache_length
        return backbone, (storage(self.config.depth, depth_length), storage(self.config.depth, depth_length))

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, frames: int, sample: Sampler) -> torch.Tensor:
        """Codes [B, frames, K] for B prompts of equal length [B, T]: the frame loop the engine runs
        batched, written out for one batch of requests that start together."""
        batch, length = prompt_ids.shape
        cache, (keys, values) = self.new_caches(batch, length + frames)
        positions = torch.arange(length, device=prompt_ids.device).expand(batch, length)
        embeds = self.text_embeds(prompt_ids)
        out = []
        for _ in range(frames):
            hidden, logits = self(embeds, positions, cache, int(positions[0, -1]) + 1)
            first = sample(logits, 0)
            rest = self.depth_decoder.predict_frame(hidden[:, -1], first, keys, values, sample)
            codes = torch.cat((first[:, None], rest), dim=1)
            out.append(codes)
            positions = positions[:, -1:] + 1
            embeds = self.frame_embeds(codes)[:, None]
        return torch.stack(out, dim=1)
