"""From a fused q/k/v projection to attention's inputs: per-head RMS norm, rotary embedding, and the
keys and values written into a static KV cache, in one kernel.

In PyTorch this is ten small kernels per layer call: the q and k norms, three for each rotary
embedding (multiply, roll, multiply-add) and a scatter each for keys and values, and a frame step
makes 103 layer calls (the talker's 28 layers, the predictor's 5 layers 15 times). Here one program
per (row, new token) loads that token's q, k and v heads once, normalises and rotates q and k,
writes k and v into the cache at the token's position, and q to a tensor of its own.

It rounds where the PyTorch formulas round (the norm's output, then the product with cos, then the
sum), so bf16 results match them to within the last bit of the fp32 sums' order. With an FP8 cache
(scales given), keys and values go in as `quantize_rows_reference` makes them from those entries: the
same amax, division and rounding, so equal entries give equal bytes and scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import FP8, FP8_MAX, MIN_AMAX, quantize_rows_reference
from .registry import (
    Comparison,
    launch_device,
    launch_options,
    programmatic_launch,
    register_check,
    triton,
    triton_usable,
)

if triton is not None:
    import triton.language as tl

    from .fp8 import to_e4m3_grid
    from .registry import await_inputs


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in rotate-half layout. x: [B, heads, T, D]; cos, signed_sin [B, 1, T, D] (signed_sin is
    (-sin, sin) over the two halves): rotate-half(x) * sin == roll(x, D/2) * signed_sin."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


def split_heads(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
):
    """qkv [B, T, heads + 2 * kv_heads, D] -> q [B, heads, T, D] and k, v [B, kv_heads, T, D]: q and k
    normalised per head (when the model has q/k norms; weights [D]) and rotated."""
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)
    if q_norm is not None:
        q, k = F.rms_norm(q, q_norm.shape, q_norm, eps), F.rms_norm(k, k_norm.shape, k_norm, eps)
    return (
        apply_rotary(q.transpose(1, 2), cos, signed_sin),
        apply_rotary(k.transpose(1, 2), cos, signed_sin),
        v.transpose(1, 2),
    )


def rotate_into_cache(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`split_heads`, then k and v written into key_cache / value_cache [B, kv_heads, L, D] at
    positions [B, T] (each below L). Returns q [B, heads, T, D]. One Triton kernel on GPUs that run
    it. One `eps` serves both norms: the models' q and k norms share `rms_norm_eps`. With scales
    [B, kv_heads, L] (an FP8 cache), each entry goes in as `quantize_rows_reference` of its D values."""
    kernel = "rotary" if key_scales is None else "rotary_fp8"
    if serves_head_size(qkv.shape[-1]) and triton_usable(qkv.device, kernel):
        inputs = (qkv, heads, kv_heads, q_norm, k_norm, eps, cos, signed_sin, key_cache, value_cache)
        return rotate_into_cache_triton(
            *inputs, positions, key_scales, value_scales, pdl=programmatic_launch(qkv.device)
        )
    q, k, v = split_heads(qkv, heads, kv_heads, q_norm, k_norm, eps, cos, signed_sin)
    index = positions[:, None, :, None].expand_as(k)
    for cache, scales, entries in ((key_cache, key_scales, k), (value_cache, value_scales, v)):
        if scales is None:
            cache.scatter_(2, index, entries)
        else:
            entries, scale = quantize_rows_reference(entries)
            scales.scatter_(2, index[..., 0], scale[..., 0])
            # PyTorch scatters no FP8 on the CPU: the bytes go in as they are.
            cache.view(torch.uint8).scatter_(2, index, entries.view(torch.uint8))
    return q


def serves_head_size(dim: int) -> bool:
    """Whether the kernel serves heads of `dim`: a power of two, split into two halves of at least 2."""
    return dim >= 4 and dim & (dim - 1) == 0


def rotate_into_cache_triton(
    qkv,
    heads,
    kv_heads,
    q_norm,
    k_norm,
    eps,
    cos,
    signed_sin,
    key_cache,
    value_cache,
    positions,
    key_scales=None,
    value_scales=None,
    pdl: bool = False,
):
    """`rotate_into_cache` in its kernel; `pdl`: a programmatic dependent launch
    (`registry.programmatic_launch`)."""
    batch, length, total_heads, dim = qkv.shape
    if not serves_head_size(dim):
        raise ValueError(f"rotate_into_cache needs a power-of-two head size of at least 4, got {dim}")
    if (
        qkv.stride(-1) != 1
        or qkv.stride(-2) != dim
        or cos.stride(-1) != 1
        or signed_sin.stride() != cos.stride()
    ):
        raise ValueError("rotate_into_cache needs packed heads and cos/sin of one layout")
    if cos.shape[0] != batch or cos.shape[2] != length:
        raise ValueError("rotate_into_cache needs cos/sin for every row and new token (no broadcasting)")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("rotate_into_cache needs key and value caches of one layout, unit stride along D")
    fp8 = key_scales is not None
    if fp8 and (
        key_cache.dtype != FP8 or key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1
    ):
        raise ValueError(
            "rotate_into_cache needs an FP8 cache and scales of one layout, unit position stride"
        )
    q = torch.empty(batch, heads, length, dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    with launch_device(qkv):
        _rotate_into_cache_kernel[(batch, length)](
            qkv,
            qkv.stride(0),
            qkv.stride(1),
            cos,
            signed_sin,
            cos.stride(0),
            cos.stride(2),
            q_norm if has_norm else qkv,
            k_norm if has_norm else qkv,
            eps,
            q,
            key_cache,
            value_cache,
            *key_cache.stride()[:3],
            key_scales if fp8 else key_cache,
            value_scales if fp8 else value_cache,
            *(key_scales.stride()[:2] if fp8 else (0, 0)),
            MIN_AMAX,
            FP8_MAX,
            positions,
            *positions.stride(),
            length,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(total_heads),
            HAS_NORM=has_norm,
            KV_FP8=fp8,
            **launch_options(pdl),
        )
    return q


@register_check("rotary")
def check_rotary(device: torch.device) -> list[Comparison]:
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 1, 4, 8, generator=generator)  # 2 query heads, 1 KV head, head size 8
    rotary = [torch.randn(2, 1, 1, 8, generator=generator) for _ in range(2)]
    norms = [torch.rand(8, generator=generator) + 0.5 for _ in range(2)]
    positions = torch.tensor([[1], [4]])
    caches = torch.zeros(2, 2, 1, 6, 8)
    qkv_, q_norm, k_norm, cos, sin, caches_, positions_ = (
        t.to(device) for t in (qkv, *norms, *rotary, caches, positions)
    )
    q = rotate_into_cache_triton(
        qkv_, 2, 1, q_norm, k_norm, 1e-6, cos, sin, caches_[0], caches_[1], positions_
    )
    q_reference = rotate_into_cache(qkv, 2, 1, *norms, 1e-6, *rotary, caches[0], caches[1], positions)
    return [(q, q_reference, 1e-5), (caches_, caches, 1e-5)]


@register_check("rotary_fp8")
def check_rotary_fp8(device: torch.device) -> list[Comparison]:
    """The kernel's FP8 cache writes, bf16 inputs as served: dequantised entries within one FP8 step
    (2**-3 of a value) of the formula's, as bf16 rounding one bit apart may move one."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("FP8 needs compute capability 8.9 or newer")
    generator = torch.Generator().manual_seed(4)
    qkv = (torch.randn(2, 1, 4, 8, generator=generator) * 3).bfloat16()
    rotary = [torch.randn(2, 1, 1, 8, generator=generator).bfloat16() for _ in range(2)]
    positions = torch.tensor([[1], [4]])
    caches, scales = torch.zeros(2, 2, 1, 6, 8, dtype=FP8), torch.zeros(2, 2, 1, 6)
    qkv_, cos, sin, caches_, scales_, positions_ = (
        t.to(device) for t in (qkv, *rotary, caches, scales, positions)
    )
    q = rotate_into_cache_triton(
        qkv_, 2, 1, None, None, 0.0, cos, sin, caches_[0], caches_[1], positions_, scales_[0], scales_[1]
    )
    q_reference = rotate_into_cache(
        qkv, 2, 1, None, None, 0.0, *rotary, caches[0], caches[1], positions, scales[0], scales[1]
    )
    entries = caches_.float().cpu() * scales_.cpu()[..., None]
    return [(q, q_reference, 2e-2), (entries, caches.float() * scales[..., None], 0.13)]


if triton is not None:
    # Unspecialised new-token count and positions' row stride: prefills of every length share the decode
    # step's compiled kernel, so no compile stalls serving. Other strides stay specialised (vector loads).
    @triton.jit(do_not_specialize=["positions_row_stride", "length"])
    def _rotate_into_cache_kernel(
        qkv,
        qkv_row_stride,
        qkv_token_stride,
        cos,
        sin,
        rotary_row_stride,
        rotary_token_stride,
        q_norm,
        k_norm,
        eps,
        q_out,
        key_cache,
        value_cache,
        cache_row_stride,
        cache_head_stride,
        cache_position_stride,
        key_scales,
        value_scales,
        scale_row_stride,
        scale_head_stride,
        min_amax,
        fp8_max,
        positions,
        positions_row_stride,
        positions_token_stride,
        length,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        HAS_NORM: tl.constexpr,
        KV_FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row, token = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        dtype = qkv.dtype.element_ty
        # Heads in projection order: q (HEADS), k (KV_HEADS), v (KV_HEADS); each split into halves for
        # the rotate-half layout.
        head = tl.arange(0, BLOCK_HEADS)
        lane = tl.arange(0, HALF)
        is_q, is_k = head < HEADS, (head >= HEADS) & (head < HEADS + KV_HEADS)
        is_v = (head >= HEADS + KV_HEADS) & (head < HEADS + 2 * KV_HEADS)
        source = (
            qkv + row * qkv_row_stride + token * qkv_token_stride + head[:, None] * (2 * HALF) + lane[None, :]
        )
        present = (is_q | is_k | is_v)[:, None]
        first = tl.load(source, mask=present, other=0.0).to(tl.float32)
        second = tl.load(source + HALF, mask=present, other=0.0).to(tl.float32)
        rotated = (is_q | is_k)[:, None]
        if HAS_NORM:
            inverse_rms = tl.rsqrt(
                (tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)) / (2 * HALF) + eps
            )
            q_weight_first = tl.load(q_norm + lane).to(tl.float32)[None, :]
            k_weight_first = tl.load(k_norm + lane).to(tl.float32)[None, :]
            q_weight_second = tl.load(q_norm + HALF + lane).to(tl.float32)[None, :]
            k_weight_second = tl.load(k_norm + HALF + lane).to(tl.float32)[None, :]
            weight_first = tl.where(is_q[:, None], q_weight_first, k_weight_first)
            weight_second = tl.where(is_q[:, None], q_weight_second, k_weight_second)
            first = tl.where(
                rotated, (first * inverse_rms[:, None] * weight_first).to(dtype).to(tl.float32), first
            )
            second = tl.where(
                rotated, (second * inverse_rms[:, None] * weight_second).to(dtype).to(tl.float32), second
            )
        rotary = row * rotary_row_stride + token * rotary_token_stride + lane
        cos_first = tl.load(cos + rotary).to(tl.float32)[None, :]
        cos_second = tl.load(cos + rotary + HALF).to(tl.float32)[None, :]
        sin_first = tl.load(sin + rotary).to(tl.float32)[None, :]
        sin_second = tl.load(sin + rotary + HALF).to(tl.float32)[None, :]
        # x * cos + roll(x, HALF) * signed sin: the first half pairs with the second and back.
        rotated_first = ((first * cos_first).to(dtype).to(tl.float32) + second * sin_first).to(dtype)
        rotated_second = ((second * cos_second).to(dtype).to(tl.float32) + first * sin_second).to(dtype)
        q_target = q_out + ((row * HEADS + head[:, None]) * length + token) * (2 * HALF) + lane[None, :]
        tl.store(q_target, rotated_first, mask=is_q[:, None])
        tl.store(q_target + HALF, rotated_second, mask=is_q[:, None])
        position = tl.load(positions + row * positions_row_stride + token * positions_token_stride)
        slot = row * cache_row_stride + position * cache_position_stride + lane[None, :]
        key_first, key_second, value_first, value_second = (
            rotated_first,
            rotated_second,
            first.to(dtype),
            second.to(dtype),
        )
        if KV_FP8:
            # Each k and v head to FP8 with its own scale, its largest magnitude mapped to 448.
            entry_first = tl.where(is_k[:, None], rotated_first.to(tl.float32), first)
            entry_second = tl.where(is_k[:, None], rotated_second.to(tl.float32), second)
            amax = tl.maximum(tl.max(tl.abs(entry_first), axis=1), tl.max(tl.abs(entry_second), axis=1))
            head_scale = tl.math.div_rn(tl.maximum(amax, min_amax), fp8_max)
            fp8 = key_cache.dtype.element_ty
            key_first = to_e4m3_grid(entry_first, head_scale[:, None], fp8_max).to(fp8)
            key_second = to_e4m3_grid(entry_second, head_scale[:, None], fp8_max).to(fp8)
            value_first, value_second = key_first, key_second
            scale_slot = row * scale_row_stride + position
            tl.store(key_scales + scale_slot + (head - HEADS) * scale_head_stride, head_scale, mask=is_k)
            tl.store(
                value_scales + scale_slot + (head - HEADS - KV_HEADS) * scale_head_stride,
                head_scale,
                mask=is_v,
            )
        k_target = key_cache + slot + (head[:, None] - HEADS) * cache_head_stride
        tl.store(k_target, key_first, mask=is_k[:, None])
        tl.store(k_target + HALF, key_second, mask=is_k[:, None])
        v_target = value_cache + slot + (head[:, None] - HEADS - KV_HEADS) * cache_head_stride
        tl.store(v_target, value_first, mask=is_v[:, None])
        tl.store(v_target + HALF, value_second, mask=is_v[:, None])
