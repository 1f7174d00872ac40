"""The 12 Hz speech tokenizer's encoder: reference audio (24 kHz) -> codes, 16 per 80 ms frame.

A Mimi encoder, as the official tokenizer runs it: a causal SEANet convolution stack (25 Hz), a
sliding-window transformer, a strided convolution to 12.5 Hz and split residual vector quantizers
(one semantic codebook, then acoustic ones). The codes of the in-context voice prompt come from
here. Module names mirror the checkpoint (`encoder.encoder.layers.0.conv.weight`, ...) under the
speech tokenizer's `encoder.` prefix.

Recordings of different lengths go in one batch, zero-padded to a common length, with their own
`lengths`: every layer is causal, so a frame never reads what follows it, except where a strided
layer pads its own end to whole frames (the last frame of a recording depends on where it ends).
Those layers see each row's tail past its length replaced by the padding that row alone would get,
so each recording's codes are those it gets alone (equal up to float rounding, which the shapes
change). Fixed shapes are what lets the encoder run as CUDA graphs (`engine.encoder_runner`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SpeechEncoderConfig


class CausalConv1d(nn.Module):
    """Mimi's causal convolution: left padding of (kernel - stride), right padding to whole frames."""

    def __init__(
        self, in_ch: int, out_ch: int, kernel: int, stride=1, dilation=1, bias=True, mode="constant"
    ):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, stride, dilation=dilation, bias=bias)
        self.stride, self.mode = stride, mode
        self.kernel = (kernel - 1) * dilation + 1
        self.padding = self.kernel - stride

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, C, T]; lengths [B]: each row's own length (None: all T). A strided layer's output
        frame may read past a row's end, so there the row's tail becomes its own end padding."""
        if lengths is not None and self.stride > 1:
            x = self._pad_tail(x, lengths)
        extra = self._extra(x.shape[-1])
        return self.conv(F.pad(x, (self.padding, extra), mode=self.mode))

    def _extra(self, length):
        """Right padding that completes the last frame (an int, or per row for a tensor of lengths)."""
        frames = -((self.kernel - self.padding - length) // self.stride)  # ceil((length - k + pad) / s)
        return frames * self.stride + self.kernel - self.padding - length

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        return (lengths + self.padding + self._extra(lengths) - self.kernel) // self.stride + 1

    def _pad_tail(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        inside = torch.arange(x.shape[-1], device=x.device) < lengths[:, None]
        if self.mode == "replicate":
            last = x.gather(2, (lengths - 1)[:, None, None].expand(-1, x.shape[1], 1))
        else:
            last = torch.zeros((), device=x.device, dtype=x.dtype)
        return torch.where(inside[:, None, :], x, last)


class ResnetBlock(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, mode=cfg.pad_mode),
                nn.ELU(),
                CausalConv1d(hidden, dim, 1, mode=cfg.pad_mode),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        for layer in self.block:
            x = layer(x)
        return residual + x


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(1, cfg.num_filters, cfg.kernel_size, mode=cfg.pad_mode)]
        dim = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [
                ResnetBlock(cfg, dim, cfg.dilation_growth_rate**j) for j in range(cfg.num_residual_layers)
            ]
            layers += [nn.ELU(), CausalConv1d(dim, dim * 2, ratio * 2, stride=ratio, mode=cfg.pad_mode)]
            dim *= 2
        layers += [
            nn.ELU(),
            CausalConv1d(dim, cfg.transformer.hidden_size, cfg.last_kernel_size, mode=cfg.pad_mode),
        ]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None):
        """-> (features, their lengths per row, or None)"""
        for layer in self.layers:
            if isinstance(layer, CausalConv1d):
                x = layer(x, lengths)
                lengths = None if lengths is None else layer.output_lengths(lengths)
            else:
                x = layer(x)  # activations and residual blocks: stride 1, causal
        return x, lengths


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class SelfAttention(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        t = cfg.transformer
        self.heads, self.kv_heads, self.head_dim = t.num_heads, t.num_kv_heads, t.head_dim
        self.q_proj = nn.Linear(t.hidden_size, t.num_heads * t.head_dim, bias=False)
        self.k_proj = nn.Linear(t.hidden_size, t.num_kv_heads * t.head_dim, bias=False)
        self.v_proj = nn.Linear(t.hidden_size, t.num_kv_heads * t.head_dim, bias=False)
        self.o_proj = nn.Linear(t.num_heads * t.head_dim, t.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor):
        batch, length, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        weights = torch.softmax(
            q @ k.transpose(2, 3) * self.head_dim**-0.5 + bias, dim=-1, dtype=torch.float32
        )
        out = (weights.to(q.dtype) @ v).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        t = cfg.transformer
        self.input_layernorm = nn.LayerNorm(t.hidden_size, eps=t.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(t.hidden_size, eps=t.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(t.hidden_size, t.intermediate_size, bias=False)
        self.mlp.fc2 = nn.Linear(t.intermediate_size, t.hidden_size, bias=False)
        self.self_attn_layer_scale = LayerScale(t.hidden_size)
        self.mlp_layer_scale = LayerScale(t.hidden_size)

    def forward(self, x, cos, sin, bias):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, bias))
        hidden = self.mlp.fc2(F.gelu(self.mlp.fc1(self.post_attention_layernorm(x))))
        return x + self.mlp_layer_scale(hidden)


class EncoderTransformer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        t = cfg.transformer
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(t.num_layers))
        self.window, self.head_dim, self.theta = t.sliding_window, t.head_dim, t.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]: causal attention over the last `window` positions."""
        length = x.shape[1]
        positions = torch.arange(length, device=x.device)
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float) / self.head_dim
        )
        freqs = positions.float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        query, key = positions[:, None], positions[None, :]
        allowed = (key <= query) & (key > query - self.window)
        bias = torch.zeros(allowed.shape, device=x.device, dtype=x.dtype).masked_fill(~allowed, float("-inf"))
        for layer in self.layers:
            x = layer(x, cos, sin, bias)
        return x


class Codebook(nn.Module):
    """A Mimi codebook (the 12 Hz tokenizer's encoder, CSM's codec): entries are usage-weighted sums."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.initialized = nn.Parameter(torch.ones(1))  # encoder-side flag, kept for a strict layout
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embed_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class ResidualQuantizer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig, count: int):
        super().__init__()
        hidden = cfg.transformer.hidden_size
        self.layers = nn.ModuleList(nn.Module() for _ in range(count))
        for layer in self.layers:
            layer.codebook = Codebook(cfg.codebook_size, cfg.codebook_dim)
        projected = cfg.quantizer_dim != hidden
        self.input_proj = nn.Conv1d(hidden, cfg.quantizer_dim, 1, bias=False) if projected else None
        # Used by the tokenizer's decoder side only; kept so that loading stays strict.
        self.output_proj = nn.Conv1d(cfg.quantizer_dim, hidden, 1, bias=False) if projected else None

    def encode(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """x [B, hidden, T] -> codes [B, count, T]: each codebook's nearest entry to the residual."""
        residual = (self.input_proj(x) if self.input_proj is not None else x).transpose(1, 2)
        codes = []
        for layer in self.layers[:count]:
            table = layer.codebook.table()
            flat = residual.reshape(-1, residual.shape[-1])
            index = torch.cdist(flat[None].float(), table[None].float())[0].argmin(dim=-1)
            index = index.view(residual.shape[:-1])
            residual = residual - F.embedding(index, table)
            codes.append(index)
        return torch.stack(codes, dim=1)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        semantic = cfg.num_semantic_quantizers
        self.semantic = semantic
        self.semantic_residual_vector_quantizer = ResidualQuantizer(cfg, semantic)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(cfg, cfg.num_quantizers - semantic)

    def encode(self, x: torch.Tensor, count: int) -> torch.Tensor:
        semantic = self.semantic_residual_vector_quantizer.encode(x, self.semantic)
        acoustic = self.acoustic_residual_vector_quantizer.encode(x, count - self.semantic)
        return torch.cat((semantic, acoustic), dim=1)


class MimiEncoder(nn.Module):
    """The encoder side of a Mimi codec; parameter names are the codec's (CSM's `codec_model.*`)."""

    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        hidden = cfg.transformer.hidden_size
        self.config = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        self.downsample = CausalConv1d(hidden, hidden, 4, stride=2, bias=False, mode="replicate")
        self.quantizer = SplitQuantizer(cfg)

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Waveforms [B, samples] at 24 kHz -> codes [B, frames, num_codes], one frame per started
        `samples_per_frame`. lengths [B]: each row's samples, the rest zeros (None: all); a row's
        codes are then its first `frames(length)`."""
        x, lengths = self.encoder(audio[:, None].to(self.downsample.conv.weight.dtype), lengths)
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        codes = self.quantizer.encode(self.downsample(x, lengths), self.config.num_codes)
        return codes[:, :, : self.frames(audio.shape[1])].transpose(1, 2)

    def frames(self, samples: int) -> int:
        return -(-samples // self.config.samples_per_frame)


class SpeechEncoder(nn.Module):
    """Root module so parameter names carry the speech tokenizer's `encoder.` prefix."""

    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        self.config = cfg
        self.encoder = MimiEncoder(cfg)

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(audio, lengths)

    def frames(self, samples: int) -> int:
        return self.encoder.frames(samples)
