"""Attention of a few new tokens per row over a static KV cache, reading only what each row has written.

A frame step attends over the cache up to the batch's attention-span bucket, so with SDPA every row
pays for the longest row (and the bucket's padding above it); this kernel stops each row at its own
position.

One program per (row, KV head) holds that head's query group (the query heads that share the KV head,
times the new tokens: 2 or 4 rows here) and streams the row's keys and values once, with an online
softmax (flash attention's recurrence). Causal by position: the query at position p sees cache
entries 0..p.

An FP8 cache (float8_e4m3fn entries, each with an fp32 scale: `kernels.fp8.quantize_rows_reference` of
its head dimension) halves the bytes read. Entries widen exactly to the query's dtype (every e4m3
value is a bf16 value); key scales then multiply the scores and value scales the softmax weights, per
key: BLOCK_ROWS x BLOCK_KEYS products where dequantising would take BLOCK_KEYS x DIM.
"""

from __future__ import annotations

import torch

from .fp8 import quantize_rows_reference
from .registry import Comparison, launch_device, launch_options, register_check, triton, triton_usable

if triton is not None:
    import triton.language as tl

    from .registry import await_inputs

# A program's query block: (query heads per KV head) x (new tokens) rows, padded to this fixed size,
# which is also the smallest block tl.dot accepts. Decode steps have 2 or 4 rows.
MAX_QUERY_ROWS = 16
# Launch shapes (keys per block, warps, pipeline stages): the code predictor's 16-entry cache fits one
# small block, in far less shared memory. benchmarks/attention_speed.py times them against others.
LONG_SPAN_LAUNCH = (64, 4, 3)
SHORT_SPAN_LAUNCH = (16, 2, 2)
# An fp32 cache's long spans: two stages, as three took 140 KiB of shared memory a program, over the
# 99 KiB of Ada GPUs (tests/test_kernels.py compiles every kernel for them).
LONG_SPAN_FP32_LAUNCH = (64, 4, 2)


def launch_shape(span: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """The launch shape for calls that may read up to `span` cache entries of `dtype`."""
    if span <= SHORT_SPAN_LAUNCH[0]:
        return SHORT_SPAN_LAUNCH
    return LONG_SPAN_FP32_LAUNCH if dtype == torch.float32 else LONG_SPAN_LAUNCH


def decode_attention_supported(device: torch.device, query_rows: int, dim: int, fp8: bool = False) -> bool:
    """Whether `decode_attention` serves a query of `query_rows` (query heads per KV head x new tokens)
    and head size `dim` on `device`, over an FP8 cache with fp8: a GPU, few new tokens, a power-of-two
    head size."""
    return (
        query_rows <= MAX_QUERY_ROWS
        and dim >= 16
        and dim & (dim - 1) == 0
        and triton_usable(device, "decode_attention_fp8" if fp8 else "decode_attention")
    )


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    launch: tuple[int, int, int] | None = None,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """q [B, H, T, D] at positions [B, T] (increasing along T); keys, values [B, KVH, L, D] (views of the
    cache) with entries 0..positions[:, -1] written; entries at L and beyond are never read. All three
    need unit stride in D. `launch` overrides `launch_shape` (for measuring). With scales [B, KVH, L]
    (of one layout, unit stride in L), keys and values are FP8. Returns [B, H, T, D]. `pdl`: a
    programmatic dependent launch (`registry.programmatic_launch`)."""
    batch, heads, length, dim = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    if not q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1:
        raise ValueError("decode_attention needs unit stride along the head dimension")
    fp8 = key_scales is not None
    if fp8 and (key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1):
        raise ValueError("decode_attention needs key and value scales of one layout, unit stride along L")
    positions = positions.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_keys, warps, stages = launch or launch_shape(span, keys.dtype)
    with launch_device(q):
        _decode_attention_kernel[(batch, kv_heads)](
            q,
            *q.stride()[:3],
            keys,
            *keys.stride()[:3],
            values,
            *values.stride()[:3],
            key_scales if fp8 else keys,
            value_scales if fp8 else values,
            *(key_scales.stride()[:2] if fp8 else (0, 0)),
            out,
            positions,
            scale,
            span,
            GROUP=heads // kv_heads,
            LENGTH=length,
            DIM=dim,
            BLOCK_ROWS=MAX_QUERY_ROWS,
            BLOCK_KEYS=block_keys,
            # fp32 stays fp32 (tl.dot would round fp32 inputs to tf32); bf16 products are exact anyway.
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            KV_FP8=fp8,
            num_warps=warps,
            num_stages=stages,
            **launch_options(pdl),
        )
    return out


def dequantize(entries: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """FP8 cache entries [..., D] times their scales [...], in `dtype`; entries without scales as they are."""
    if scales is None:
        return entries
    return (entries.float() * scales[..., None]).to(dtype)


def decode_attention_reference(q, keys, values, positions, scale, key_scales=None, value_scales=None):
    """The same function through SDPA with an explicit causal-by-position mask (fp32)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (
        dequantize(t, s, torch.float32).float().repeat_interleave(group, dim=1)
        for t, s in ((keys, key_scales), (values, value_scales))
    )
    mask = torch.arange(keys.shape[2])[None, None, None, :] <= positions.cpu()[:, None, :, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys, values, attn_mask=mask.to(q.device), scale=scale
    )


@register_check("decode_attention")
def check_decode_attention(device: torch.device) -> list[Comparison]:
    generator = torch.Generator().manual_seed(2)
    comparisons = []
    # A talker-like span and the code predictor's 16 entries: they launch with different shapes
    # (`launch_shape`). Either failing sends every decode-attention call to the reference.
    for span, positions in ((80, torch.tensor([[5], [70]])), (16, torch.tensor([[3], [15]]))):
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            q = torch.randn(2, 4, 1, 128, generator=generator).to(dtype)
            keys, values = (torch.randn(2, 2, span, 128, generator=generator).to(dtype) for _ in range(2))
            out = decode_attention(
                q.to(device), keys.to(device), values.to(device), positions.to(device), 0.1
            )
            comparisons.append((out, decode_attention_reference(q, keys, values, positions, 0.1), tolerance))
    return comparisons


@register_check("decode_attention_fp8")
def check_decode_attention_fp8(device: torch.device) -> list[Comparison]:
    """Over an FP8 cache, both launch shapes, bf16 queries as served."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("FP8 needs compute capability 8.9 or newer")
    generator = torch.Generator().manual_seed(5)
    comparisons = []
    for span, positions in ((80, torch.tensor([[5], [70]])), (16, torch.tensor([[3], [15]]))):
        q = torch.randn(2, 4, 1, 128, generator=generator).bfloat16()
        (keys, key_scales), (values, value_scales) = (
            quantize_rows_reference(torch.randn(2, 2, span, 128, generator=generator) * 4) for _ in range(2)
        )
        key_scales, value_scales = key_scales[..., 0], value_scales[..., 0]
        out = decode_attention(
            *(t.to(device) for t in (q, keys, values, positions)),
            0.1,
            key_scales=key_scales.to(device),
            value_scales=value_scales.to(device),
        )
        expected = decode_attention_reference(q, keys, values, positions, 0.1, key_scales, value_scales)
        comparisons.append((out, expected, 3e-2))
    return comparisons


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        q_batch_stride,
        q_head_stride,
        q_token_stride,
        k_ptr,
        k_batch_stride,
        k_head_stride,
        k_position_stride,
        v_ptr,
        v_batch_stride,
        v_head_stride,
        v_position_stride,
        k_scale_ptr,
        v_scale_ptr,
        scale_batch_stride,
        scale_head_stride,
        out_ptr,
        positions_ptr,
        scale,
        span,
        GROUP: tl.constexpr,
        LENGTH: tl.constexpr,
        DIM: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_KEYS: tl.constexpr,
        PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
        # Query block row r is (query head kv_head * GROUP + r // LENGTH, new token r % LENGTH).
        rows = tl.arange(0, BLOCK_ROWS)
        valid_rows = rows < GROUP * LENGTH
        head, token = kv_head * GROUP + rows // LENGTH, rows % LENGTH
        dims = tl.arange(0, DIM)
        query_offsets = row * q_batch_stride + head * q_head_stride + token * q_token_stride
        query = tl.load(q_ptr + query_offsets[:, None] + dims[None, :], mask=valid_rows[:, None], other=0.0)
        query_position = tl.load(positions_ptr + row * LENGTH + token, mask=valid_rows, other=0)
        end = tl.minimum(tl.load(positions_ptr + row * LENGTH + LENGTH - 1) + 1, span)  # entries written

        key_base = k_ptr + row * k_batch_stride + kv_head * k_head_stride
        value_base = v_ptr + row * v_batch_stride + kv_head * v_head_stride
        best = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_ROWS,), tl.float32)
        acc = tl.zeros((BLOCK_ROWS, DIM), tl.float32)
        for start in range(0, end, BLOCK_KEYS):
            key_positions = start + tl.arange(0, BLOCK_KEYS)
            inside = key_positions < end
            # FP8 entries widen exactly; bf16 and fp32 ones are the query's dtype already.
            key = tl.load(
                key_base + key_positions[:, None] * k_position_stride + dims[None, :],
                mask=inside[:, None],
                other=0.0,
            ).to(query.dtype)
            value = tl.load(
                value_base + key_positions[:, None] * v_position_stride + dims[None, :],
                mask=inside[:, None],
                other=0.0,
            ).to(query.dtype)
            scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * scale
            if KV_FP8:
                scale_offsets = row * scale_batch_stride + kv_head * scale_head_stride + key_positions
                key_scale = tl.load(k_scale_ptr + scale_offsets, mask=inside, other=0.0)
                value_scale = tl.load(v_scale_ptr + scale_offsets, mask=inside, other=0.0)
                scores = scores * key_scale[None, :]
            visible = key_positions[None, :] <= query_position[:, None]
            scores = tl.where(visible, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # Rows with nothing visible yet keep -inf; their correction and weights stay 0, not NaN.
            safe_best = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - safe_best[:, None])
            correction = tl.exp(best - safe_best)
            total = total * correction + tl.sum(weights, axis=1)
            if KV_FP8:
                weights = weights * value_scale[None, :]
            acc = acc * correction[:, None] + tl.dot(
                weights.to(value.dtype), value, input_precision=PRECISION
            )
            best = new_best
        result = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        out_offsets = ((row * (GROUP * tl.num_programs(1)) + head) * LENGTH + token) * DIM
        tl.store(
            out_ptr + out_offsets[:, None] + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=valid_rows[:, None],
        )
