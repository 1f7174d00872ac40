"""The elementwise work around a decoder layer's projections, in one kernel each.

A frame step makes 103 layer calls (the talker's 28 layers, the predictor's 5 layers 15 times), and
in PyTorch each call runs two residual adds, two RMS norms and, in the MLP, a SiLU and a product:
six small kernels whose cost is their launches and their passes over the activations, not their
arithmetic. Here they become three:

- `add_rms_norm`: the residual add and the RMS norm that follows it (the next sub-layer's input norm),
  one pass that returns both the normalised input and the new residual stream;
- `silu_and_mul`: SiLU of the gate times the up projection, from the fused gate/up projection's output.

Both round where the PyTorch formulas round: the sum to the input's dtype before it is normalised
(as `x + residual` does), the norm once at the end of its fp32 computation (as `F.rms_norm` does),
the SiLU to the dtype before the product (as `F.silu(gate) * up` does). In bf16 they match the
formulas except for rare last-bit differences where the fp32 sum of squares, summed in another order,
or the GPU's fast exp and rsqrt land on the other side of a rounding boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

    from .registry import await_inputs

# silu_and_mul's columns per program: intermediate sizes run to several thousand, more than one
# program should hold.
SILU_BLOCK = 1024


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return F.rms_norm(summed, weight.shape, weight, eps), summed


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) over the last dimension, which `weight` [D] scales.
    x and residual: one shape and dtype."""
    if triton_usable(x.device, "add_rms_norm"):
        return add_rms_norm_triton(x, residual, weight, eps, pdl=programmatic_launch(x.device))
    return add_rms_norm_reference(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    if triton_usable(gate_up.device, "silu_and_mul"):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., D] as [rows, D] with unit stride along D (a view where the layout allows)."""
    return (
        tensor.reshape(-1, tensor.shape[-1])
        if tensor.stride(-1) == 1
        else tensor.contiguous().view(-1, tensor.shape[-1])
    )


def add_rms_norm_triton(x, residual, weight, eps, pdl: bool = False):
    """`pdl`: a programmatic dependent launch (`registry.programmatic_launch`)."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError("add_rms_norm needs x and residual of one shape and dtype")
    size = x.shape[-1]
    x_rows, residual_rows = _rows(x), _rows(residual)
    normed, summed = (torch.empty(x_rows.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    with launch_device(x):
        _add_rms_norm_kernel[(x_rows.shape[0],)](
            x_rows,
            x_rows.stride(0),
            residual_rows,
            residual_rows.stride(0),
            weight,
            eps,
            normed,
            summed,
            size,
            BLOCK=triton.next_power_of_2(size),
            **launch_options(pdl),
        )
    return normed.view(x.shape), summed.view(x.shape)


def silu_and_mul_triton(gate_up):
    width = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    with launch_device(gate_up):
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, SILU_BLOCK))](
            rows, rows.stride(0), out, width, BLOCK=SILU_BLOCK
        )
    return out.view(*gate_up.shape[:-1], width)


@register_check("add_rms_norm")
def check_add_rms_norm(device: torch.device) -> list[Comparison]:
    generator = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator)
    weight = torch.rand(40, generator=generator) + 0.5
    normed, summed = add_rms_norm_triton(x.to(device), residual.to(device), weight.to(device), 1e-6)
    normed_reference, summed_reference = add_rms_norm_reference(x, residual, weight, 1e-6)
    return [(normed, normed_reference, 1e-5), (summed, summed_reference, 1e-5)]


@register_check("silu_and_mul")
def check_silu_and_mul(device: torch.device) -> list[Comparison]:
    gate_up = torch.randn(2, 3, 80, generator=torch.Generator().manual_seed(6)) * 3
    return [(silu_and_mul_triton(gate_up.to(device)), silu_and_mul_reference(gate_up), 1e-5)]


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x, x_row_stride, residual, residual_row_stride, weight, eps, normed, summed, size,
        PDL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per row: the row's sum stays in registers between the add and the norm.
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        dtype = x.dtype.element_ty
        column = tl.arange(0, BLOCK)
        inside = column < size
        value = tl.load(x + row * x_row_stride + column, mask=inside, other=0.0).to(tl.float32)
        value += tl.load(residual + row * residual_row_stride + column, mask=inside, other=0.0).to(tl.float32)
        # The norm reads the sum as stored, rounded to the dtype.
        value = value.to(dtype)
        tl.store(summed + row * size + column, value, mask=inside)
        value = value.to(tl.float32)
        inverse_rms = tl.rsqrt(tl.sum(value * value, axis=0) / size + eps)
        scale = tl.load(weight + column, mask=inside, other=0.0).to(tl.float32)
        tl.store(normed + row * size + column, (value * inverse_rms * scale).to(dtype), mask=inside)

    @triton.jit
    def _silu_and_mul_kernel(gate_up, row_stride, out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        dtype = gate_up.dtype.element_ty
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = column < width
        gate = tl.load(gate_up + row * row_stride + column, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * row_stride + width + column, mask=inside, other=0.0).to(tl.float32)
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        tl.store(out + row * width + column, (silu * up).to(dtype), mask=inside)
