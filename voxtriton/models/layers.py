"""Building blocks shared by the talker, the code predictor and the codec's pre-transformer.

Plain PyTorch, no framework layers. Projections that run together are fused (q/k/v, gate/up); the
checkpoint loader splits the official tensors into them (see `loader.FUSED_PROJECTIONS`).
Attention takes its keys and values from a caller-owned cache object, so the same layer serves a
static per-slot KV cache (talker, predictor) and a sliding window carried in codec state.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import decode_attention, decode_attention_supported, dequantize
from ..kernels.fp8 import FP8
from ..kernels.linear import linear, linear_silu_and_mul
from ..kernels.norm import add_rms_norm, silu_and_mul
from ..kernels.registry import programmatic_launch
from ..kernels.rotary import rotate_into_cache, split_heads
from .config import TransformerConfig

# attend(q [B, H, T, D], keys, values [B, KVH, L, D], scale, key_scales, value_scales [B, KVH, L] of an
# FP8 cache or None) -> [B, H, T, D]
Attend = Callable[..., torch.Tensor]


class Linear(nn.Linear):
    """`nn.Linear` whose products of one row (a decode step of one stream) run in the one-row kernel
    (`kernels.linear`) on GPUs that run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x; with a residual, the norm of x + residual and that sum: (normed, summed), the
        residual add fused into the norm (one kernel on GPUs that run it)."""
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps)
        # One fused kernel (it accumulates in fp32, as the official implementation normalises in
        # fp32); fp32 results equal the official ones.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE with rotate-half layout. Positions are per token, so every request keeps its own."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inverse_frequencies(None), persistent=False)
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None  # see `tabulate`

    def _inverse_frequencies(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponent)

    def reset(self, device) -> None:
        """Recompute the (fp32) frequencies after the module was built on the meta device or cast."""
        self.inv_freq = self._inverse_frequencies(device)
        self.table = None

    def tabulate(self, positions: int, dtype: torch.dtype) -> None:
        """Keep cos and signed sin of positions 0..positions-1 in `dtype`, so a call looks them up
        (one gather each) instead of computing them (nine small kernels, 16 calls a frame step).

        For callers that bound their positions, as the model runner does (its KV cache's length, the
        predictor's 16): a position past the table is out of its range. The values are the computed
        ones, bit for bit. A table already long enough for `dtype` is kept (runners may share a model)."""
        if self.table is not None and self.table[0].dtype == dtype and self.table[0].shape[0] >= positions:
            return
        self.table = self._compute(torch.arange(positions, device=self.inv_freq.device), dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, [B, 1, T, D]: rotate-half(x) * sin == roll(x, D/2) * signed sin."""
        if self.table is not None and self.table[0].dtype == dtype:
            cos, signed_sin = (values[positions] for values in self.table)
        else:
            cos, signed_sin = self._compute(positions, dtype)
        return cos[:, None], signed_sin[:, None]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        sin = freqs.sin()
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


class KVStore(Protocol):
    """Where a layer's keys and values live between steps, when not in a `StaticKV`."""

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values [B, kv_heads, T, D]; return everything to attend to."""


def attention_bias(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias for `grouped_attention` from a [B, 1, T, L] mask (True = attend), made once per
    step and shared by every layer: [B, 1, group*T, L], 0 where attending, -inf elsewhere."""
    batch, _, length, span = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.unsqueeze(2).expand(batch, 1, group, length, span).reshape(batch, 1, group * length, span)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q: [B, H, T, D]; k, v: [B, KVH, L, D] (FP8 with scales [B, KVH, L]: dequantised to q's dtype
    first); bias from `attention_bias`. The query heads that share a KV head are folded into the
    query-length axis, so one SDPA call over KVH heads reads each key once (this also keeps the fused
    GPU kernels eligible).
    """
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    k, v = dequantize(k, key_scales, q.dtype), dequantize(v, value_scales, q.dtype)
    q = q.reshape(batch, kv_heads, heads // kv_heads * length, dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, length, dim)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, kv: "StaticKV | KVStore", attend: Attend):
        batch, length, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, length, -1, self.head_dim)
        q_norm, k_norm = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        eps = 0.0 if self.q_norm is None else self.q_norm.eps
        if isinstance(kv, StaticKV):
            parts = kv.layer_rows(self.layer, batch)  # keys, values, key scales, value scales
            q = rotate_into_cache(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                q_norm,
                k_norm,
                eps,
                cos,
                sin,
                *parts[:2],
                kv.positions,
                *parts[2:],
            )
            keys, values, key_scales, value_scales = (
                None if part is None else part[:, :, : kv.span] for part in parts
            )
            out = attend(q, keys, values, scale=self.scale, key_scales=key_scales, value_scales=value_scales)
        else:
            q, k, v = split_heads(qkv, self.num_heads, self.num_kv_heads, q_norm, k_norm, eps, cos, sin)
            out = attend(q, *kv.update(self.layer, k, v), scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # One launch for both where the one-row kernel serves; an FP8 projection (`Fp8Linear`) runs
        # its own product.
        if isinstance(gate_up, Linear):
            return self.down_proj(linear_silu_and_mul(x, gate_up.weight))
        return self.down_proj(silu_and_mul(gate_up(x)))


class LayerScale(nn.Module):
    def __init__(self, size: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((size,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer: int, layer_scale: float | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The codec's pre-transformer scales both residual branches (layer scale); the talker does not.
        if layer_scale is not None:
            self.self_attn_layer_scale = LayerScale(cfg.hidden_size, layer_scale)
            self.mlp_layer_scale = LayerScale(cfg.hidden_size, layer_scale)
        else:
            self.self_attn_layer_scale = self.mlp_layer_scale = nn.Identity()

    def forward(self, x, residual: torch.Tensor | None, cos, sin, kv: "StaticKV | KVStore", attend: Attend):
        """x: the previous layer's MLP branch, not yet added to the residual stream `residual` (the
        first layer gets the stack's input and None). Returns this layer's MLP branch and the stream
        before it: each residual add happens in the norm that follows it."""
        if residual is None:
            hidden, residual = self.input_layernorm(x), x
        else:
            hidden, residual = self.input_layernorm(x, residual)
        branch = self.self_attn_layer_scale(self.self_attn(hidden, cos, sin, kv, attend))
        hidden, residual = self.post_attention_layernorm(branch, residual)
        return self.mlp_layer_scale(self.mlp(hidden)), residual


class DecoderStack(nn.Module):
    """Layers + final norm. Keys/values go through `kv`; `mask` is [B, 1, T, L] (True = attend), or
    None for causal attention by position over a `StaticKV` (entries 0..p for the query at position p)."""

    def __init__(self, cfg: TransformerConfig, layer_scale: float | None = None):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, layer_scale) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.head_dim = cfg.head_dim

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: "StaticKV | KVStore",
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)
        attend = self._attention(x, positions, kv, mask)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, kv, attend)
        return self.norm(x, residual)[0]

    def _attention(self, x, positions, kv, mask) -> Attend:
        """Decode steps on a GPU read each row's own entries (`decode_attention`); everything else goes
        through SDPA with a bias made once per call and shared by every layer."""
        if mask is None:
            if decode_attention_supported(x.device, self.group * x.shape[1], self.head_dim, kv.fp8):
                return partial(decode_attention, positions=positions, pdl=programmatic_launch(x.device))
            mask = causal_mask(positions, kv.span)
        return partial(grouped_attention, bias=attention_bias(mask, self.group, x.dtype))


class StaticKV:
    """A preallocated cache [layers, rows, kv_heads, length, head_dim]; new entries go to `positions`.

    The first B rows belong to the B requests of the batch. `span` limits how much of each row
    attention reads, so a step costs what the longest request needs, not the whole allocation.
    An FP8 cache (the `fp8_kv_cache` setting) holds float8_e4m3fn entries and an fp32 scale per entry,
    key_scales and value_scales [layers, rows, kv_heads, length]: about half the bytes attention reads.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_scales: torch.Tensor | None = None,
        value_scales: torch.Tensor | None = None,
    ):
        self.keys, self.values = keys, values
        self.key_scales, self.value_scales = key_scales, value_scales
        self.positions: torch.Tensor | None = None
        self.span = keys.shape[3]

    @staticmethod
    def allocate(shape: tuple[int, ...], device, dtype: torch.dtype, fp8: bool = False) -> "StaticKV":
        """Zeros of shape [layers, rows, kv_heads, length, head_dim], in `dtype` or FP8. A scale per
        entry (its largest magnitude / 448, as written) keeps one outlier from coarsening other
        positions and never changes once written, so nothing is re-quantised as a row grows."""
        if not fp8:
            return StaticKV(*(torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)))
        entries = [torch.zeros(shape, device=device, dtype=FP8) for _ in range(2)]
        return StaticKV(*entries, *(torch.zeros(shape[:-1], device=device) for _ in range(2)))

    @property
    def fp8(self) -> bool:
        return self.key_scales is not None

    def like(self, rows: int, length: int) -> "StaticKV":
        """An empty cache of the same kind, layers, heads and head size: `rows` rows of `length`."""
        layers, _, kv_heads, _, head_dim = self.keys.shape
        shape = (layers, rows, kv_heads, length, head_dim)
        return StaticKV.allocate(shape, self.keys.device, self.keys.dtype, self.fp8)

    def rows(self, index: slice) -> "StaticKV":
        """The cache of rows `index` (views)."""
        return StaticKV(*(None if part is None else part[:, index] for part in self._parts()))

    def storage(self) -> list[torch.Tensor]:
        """Every tensor of the cache, [layers, rows, kv_heads, length, ...], for copies between rows
        and caches: FP8 ones as bytes (PyTorch has no FP8 index_copy on the CPU)."""
        return [
            part.view(torch.uint8) if part.dtype == FP8 else part
            for part in self._parts()
            if part is not None
        ]

    def _parts(self) -> tuple[torch.Tensor | None, ...]:
        return self.keys, self.values, self.key_scales, self.value_scales

    def bind(self, positions: torch.Tensor, span: int) -> "StaticKV":
        """The positions [B, T] this call's new entries go to, and how far attention reads."""
        self.positions, self.span = positions, span
        return self

    def layer_rows(self, layer: int, batch: int) -> tuple[torch.Tensor | None, ...]:
        """Keys and values [batch, kv_heads, length, head_dim] of one layer, the batch's rows, and their
        scales [batch, kv_heads, length] (None unless FP8)."""
        return tuple(None if part is None else part[layer, :batch] for part in self._parts())


def causal_mask(positions: torch.Tensor, span: int) -> torch.Tensor:
    """[B, 1, T, span]: a query at position p sees cache entries 0..p."""
    keys = torch.arange(span, device=positions.device)
    return (keys <= positions[..., None]).unsqueeze(1)
