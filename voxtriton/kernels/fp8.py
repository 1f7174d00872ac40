"""Rows of a matrix in FP8 (float8_e4m3fn), each with its own scale: the operands of a row-wise scaled
matrix product (`torch._scaled_mm`), which multiplies row i of the result by both operands' scales.

Weights go through this once, at load, per output channel; activations at every call, per token. In
PyTorch a call is five small kernels (abs, amax, the scale, the division, the cast); the kernel reads
the row once and writes both outputs. Both divide by the same fp32 scale and cast with saturation to
the nearest representable value (ties to even), so they give the same bits.
"""

from __future__ import annotations

import torch

from .registry import Comparison, launch_device, register_check, triton, triton_usable

if triton is not None:
    import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# A row of zeros (a padding row) gets this amax, so its scale is not 0 and 0 / scale stays 0.
MIN_AMAX = 1e-12
# A program holds its whole row in registers: the widest projection input is the talker's FFN, 6144.
MAX_KERNEL_WIDTH = 16384


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, 1]) with x ~= FP8 * scale, each row's largest magnitude
    mapped to the format's largest value."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference`, in one kernel on GPUs that run it. x: [M, K] with unit stride in K."""
    if x.shape[-1] <= MAX_KERNEL_WIDTH and triton_usable(x.device, "fp8_quantize_rows"):
        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs unit stride along the row")
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    with launch_device(x):
        _quantize_rows_kernel[(rows,)](
            x, x.stride(0), out, scale, width, MIN_AMAX, FP8_MAX, BLOCK=triton.next_power_of_2(width)
        )
    return out, scale


@register_check("fp8_quantize_rows")
def check_quantize_rows(device: torch.device) -> list[Comparison]:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("FP8 needs compute capability 8.9 or newer")
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(7)) * 5
    x[1] = 0.0
    out, scale = quantize_rows_triton(x.to(device).bfloat16())
    out_reference, scale_reference = quantize_rows_reference(x.bfloat16())
    return [(out.float(), out_reference.float(), 0.0), (scale, scale_reference, 0.0)]


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x, row_stride, out, scale, width, min_amax, fp8_max, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        column = tl.arange(0, BLOCK)
        inside = column < width
        value = tl.load(x + row * row_stride + column, mask=inside, other=0.0).to(tl.float32)
        row_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(value), axis=0), min_amax), fp8_max)
        scaled = to_e4m3_grid(value, row_scale, fp8_max)
        tl.store(out + row * width + column, scaled.to(out.dtype.element_ty), mask=inside)
        tl.store(scale + row, row_scale)

    @triton.jit
    def to_e4m3_grid(value, scale, fp8_max):
        """value / scale, saturated and rounded to the e4m3 grid in fp32, as `quantize_rows_reference`
        divides and casts: the cast to FP8 then only re-encodes."""
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(value, scale), -fp8_max), fp8_max)
        # Round in fp32 (nearest, ties to even), so the cast only re-encodes: Triton's interpreter
        # rounds casts wrongly. 3 mantissa bits, or steps of 2**-9 below 2**-6 (subnormals).
        bits = scaled.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # fp32 numbers near 1.5 * 2**14 are 2**-9 apart; the magnitude rounds, so -0.0 keeps its sign.
        subnormal = ((tl.abs(scaled) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)
        return tl.where(tl.abs(scaled) < 0.015625, subnormal.to(tl.float32, bitcast=True), normal)
