"""The Mimi codec decoder (CSM's codec), streaming with explicit state.

Every layer of the decoder is causal: causal convolutions, causal transposed convolutions (the
frame upsampling and the SEANet blocks) and a sliding-window causal transformer. A chunk of frames
therefore decodes exactly as the same frames inside a whole utterance once each layer gets its
input's tail from the previous chunk, which `StreamState` carries (the streaming layers and the
packing are the Qwen3-TTS codec's, from `models.codec`).

Module names mirror the official checkpoint's `codec_model.*` tensors (HF `MimiModel`); the
encoder side (`encoder`, `encoder_transformer`, `downsample`, the quantizers' `input_proj`), which
turns context audio into codes, is `speech_encoder.MimiEncoder` (`loader.load_mimi_encoder`).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..codec import (
    CausalConv,
    CausalTransConv,
    PackedState,
    StateSlot,
    StreamingModule,
    StreamState,
    WindowKV,
    window_mask,
)
from ..layers import Attention, LayerScale, Rotary, attention_bias, grouped_attention
from ..speech_encoder import Codebook
from .config import MimiConfig


class MimiLayer(nn.Module):
    """Pre-norm transformer layer with LayerNorm, a GELU MLP and layer scale on both branches."""

    def __init__(self, cfg: MimiConfig, layer: int):
        super().__init__()
        t = cfg.transformer
        self.self_attn = Attention(t, layer)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(t.hidden_size, t.intermediate_size, bias=False)
        self.mlp.fc2 = nn.Linear(t.intermediate_size, t.hidden_size, bias=False)
        self.input_layernorm = nn.LayerNorm(t.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(t.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(t.hidden_size, cfg.layer_scale)
        self.mlp_layer_scale = LayerScale(t.hidden_size, cfg.layer_scale)

    def forward(self, x, cos, sin, kv: WindowKV, attend) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, kv, attend))
        hidden = self.mlp.fc2(F.gelu(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x + self.mlp_layer_scale(hidden)


class MimiTransformer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        t = cfg.transformer
        self.layers = nn.ModuleList(MimiLayer(cfg, i) for i in range(t.num_layers))
        self.rotary = Rotary(t.head_dim, t.rope_theta)
        self.window, self.group = t.sliding_window, t.num_heads // t.num_kv_heads
        self.kv = WindowKV(t.num_layers, t.num_kv_heads, t.sliding_window, t.head_dim)

    def stream(self, x: torch.Tensor, start: torch.Tensor, state: StreamState) -> torch.Tensor:
        """x [B, T, hidden]; start [B]: absolute step index of x[:, 0] (RoPE positions)."""
        positions, mask = window_mask(start, x.shape[1], self.window)
        cos, sin = self.rotary(positions, x.dtype)
        attend = partial(grouped_attention, bias=attention_bias(mask, self.group, x.dtype))
        kv = self.kv.begin(state)
        for layer in self.layers:
            x = layer(x, cos, sin, kv, attend)
        self.kv.end()
        return x


class ResnetBlock(nn.Module):
    """x + conv(elu(conv(elu(x)))): a dilated causal convolution, then a pointwise one."""

    def __init__(self, cfg: MimiConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                CausalConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
                nn.ELU(),
                CausalConv(hidden, dim, 1),
            ]
        )

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        hidden = self.block[1](F.elu(x), state)
        return x + self.block[3](F.elu(hidden), state)


class SEANetDecoder(nn.Module):
    """Latents at the transformer rate -> waveform. ELU modules sit where the checkpoint's layer
    indices expect them; they hold no weights."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        scale = 2 ** len(cfg.upsampling_ratios)
        layers: list[nn.Module] = [CausalConv(cfg.hidden_size, scale * cfg.num_filters, cfg.kernel_size)]
        for ratio in cfg.upsampling_ratios:
            dim = scale * cfg.num_filters
            layers += [nn.ELU(), CausalTransConv(dim, dim // 2, 2 * ratio, ratio)]
            layers += [
                ResnetBlock(cfg, dim // 2, cfg.dilation_growth_rate**j)
                for j in range(cfg.num_residual_layers)
            ]
            scale //= 2
        layers += [nn.ELU(), CausalConv(cfg.num_filters, 1, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        for layer in self.layers:
            x = F.elu(x) if isinstance(layer, nn.ELU) else layer(x, state)
        return x


class ResidualQuantizer(nn.Module):
    def __init__(self, cfg: MimiConfig, count: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(count))
        for layer in self.layers:
            layer.codebook = Codebook(cfg.codebook_size, cfg.codebook_dim)
        self.output_proj = (
            nn.Conv1d(cfg.projection_dim, cfg.hidden_size, 1, bias=False)
            if cfg.projection_dim != cfg.hidden_size
            else None
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, T] -> [B, hidden, T]"""
        total = sum(
            F.embedding(codes[:, i], layer.codebook.table()).transpose(1, 2)
            for i, layer in enumerate(self.layers)
        )
        return total if self.output_proj is None else self.output_proj(total)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(cfg, self.semantic)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(cfg, cfg.num_quantizers - self.semantic)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.semantic_residual_vector_quantizer.decode(
            codes[:, : self.semantic]
        ) + self.acoustic_residual_vector_quantizer.decode(codes[:, self.semantic :])


class MimiCodec(PackedState, nn.Module):
    """Codes -> waveform, chunk by chunk, for many streams at once. Parameter names are the
    checkpoint's without its `codec_model.` prefix."""

    def __init__(self, cfg: MimiConfig):
        super().__init__()
        self.config = cfg
        self.quantizer = SplitQuantizer(cfg)
        self.upsample = CausalTransConv(
            cfg.hidden_size, cfg.hidden_size, 4, 2, groups=cfg.upsample_groups, bias=False
        )
        self.decoder_transformer = MimiTransformer(cfg)
        self.decoder = SEANetDecoder(cfg)
        for name, module in self.named_modules():
            if isinstance(module, StreamingModule):
                module.state_name = name
        self.slots: list[StateSlot] = [
            slot for m in self.modules() if isinstance(m, StreamingModule) for slot in m.state_slots()
        ]
        self.state_size = sum(math.prod(slot.shape) for slot in self.slots)

    def new_state(self, batch: int, device=None, dtype=None) -> torch.Tensor:
        """A fresh stream's state, packed: [B, state_size] zeros (zero padding = silence before frame 0)."""
        param = self.upsample.conv.weight
        return torch.zeros(batch, self.state_size, device=device or param.device, dtype=dtype or param.dtype)

    def forward(self, codes: torch.Tensor, start: torch.Tensor, state: StreamState) -> torch.Tensor:
        """codes [B, T, K]; start [B] frames decoded before -> waveform [B, T * samples_per_frame]."""
        if codes.shape[-1] != self.config.num_quantizers:
            raise ValueError(
                f"expected {self.config.num_quantizers} codebooks per frame, got {codes.shape[-1]}"
            )
        latents = self.upsample(self.quantizer.decode(codes.transpose(1, 2)), state)
        latents = self.decoder_transformer.stream(latents.transpose(1, 2), 2 * start, state)
        return self.decoder(latents.transpose(1, 2), state).squeeze(1)

    @torch.inference_mode()
    def decode(
        self, codes: torch.Tensor, start: torch.Tensor, packed_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the next chunk of B streams: codes [B, T, K] int, start [B] int, packed_state
        [B, state_size] from `new_state` or a previous call -> (waveform [B, T * samples_per_frame],
        next packed state)."""
        param = self.upsample.conv.weight
        state = self.unpack(packed_state.to(param.dtype))
        wav = self(codes.long(), start.long(), state)
        return wav, self.pack(state)
