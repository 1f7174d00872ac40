"""Fused elementwise kernels of the codec decoder's convolution stack (Triton on CUDA, PyTorch elsewhere).

The decoder's activations are long ([batch, channels, frames * up to 1920]), and eager PyTorch passes
over each one several times per layer: SnakeBeta's five operations, the convolution bias (a broadcast
add on the slow, non-vectorised path), the causal padding (a concatenation with the carried state)
and the residual add. Here they become two kernels:

- `snake`: SnakeBeta of (x + the previous convolution's bias), written after the causal history the
  next convolution needs, so the padded input comes out of the same pass;
- `add_channel_bias`: a convolution's bias (+ the residual), into a contiguous tensor.

Both compute in fp32. The Triton versions run for CUDA tensors; the reference formulas below run
everywhere else and are what the kernels are tested against.
"""

from __future__ import annotations

import torch

from .registry import Comparison, launch_device, register_check, triton, triton_usable

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

BLOCK = 1024
# How far the fp32 snake on a GPU may differ from the reference: the hardware sine's ~1e-6 error,
# scaled by 1/beta and doubled by the square.
HARDWARE_SINE_TOLERANCE = 1e-4


def pad_time(y: torch.Tensor, history: torch.Tensor | None = None, tail: int = 0) -> torch.Tensor:
    """[history | y | `tail` zero columns] along time; y itself when there is nothing to add."""
    parts = (
        ([] if history is None else [history]) + [y] + ([y.new_zeros(*y.shape[:-1], tail)] if tail else [])
    )
    return torch.cat(parts, dim=-1) if len(parts) > 1 else y


def snake_reference(
    x: torch.Tensor,
    log_alpha: torch.Tensor,
    log_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    tail: int = 0,
) -> torch.Tensor:
    """x + bias -> y + sin(alpha y)^2 / beta per channel, with the checkpoint's log-scale alpha and beta
    (rounded to x's dtype), prefixed along time by `history` [B, C, H] as it is and followed by `tail`
    zero columns."""
    alpha = torch.exp(log_alpha.float()).to(x.dtype)[:, None]
    inverse_beta = (1.0 / (torch.exp(log_beta.float()) + 1e-9)).to(x.dtype)[:, None]
    if bias is not None:
        x = x + bias.to(x.dtype)[:, None]
    y = x + inverse_beta * torch.pow(torch.sin(x * alpha), 2)
    return pad_time(y, history, tail)


def add_channel_bias_reference(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    out = x + bias.to(x.dtype)[:, None]
    return out if residual is None else out + residual


def snake(x, log_alpha, log_beta, bias=None, history=None, tail=0):
    """SnakeBeta [B, C, T] -> [B, C, H + T + tail]; see `snake_reference`."""
    if triton_usable(x.device, "snake"):
        return snake_triton(x, log_alpha, log_beta, bias, history, tail)
    return snake_reference(x, log_alpha, log_beta, bias, history, tail)


def add_channel_bias(x, bias, residual=None):
    """x [B, C, T] (any strides with unit time stride) + bias [C] (+ residual [B, C, T])."""
    if triton_usable(x.device, "channel_bias"):
        return add_channel_bias_triton(x, bias, residual)
    return add_channel_bias_reference(x, bias, residual)


def _time_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def snake_triton(x, log_alpha, log_beta, bias=None, history=None, tail=0):
    x = _time_contiguous(x)
    batch, channels, length = x.shape
    history_length = 0 if history is None else history.shape[-1]
    if history is not None:
        history = _time_contiguous(history)
    out = torch.empty(batch, channels, history_length + length + tail, device=x.device, dtype=x.dtype)
    grid = (batch * channels, triton.cdiv(out.shape[-1], BLOCK))
    with launch_device(x):
        _snake_kernel[grid](
            x,
            x.stride(0),
            x.stride(1),
            length,
            history if history is not None else x,
            *(history.stride()[:2] if history is not None else (0, 0)),
            history_length,
            log_alpha,
            log_beta,
            bias if bias is not None else log_alpha,
            out,
            channels,
            tail,
            HAS_BIAS=bias is not None,
            HARDWARE_SINE=x.is_cuda,
            BLOCK=BLOCK,
        )
    return out


def add_channel_bias_triton(x, bias, residual=None):
    x = _time_contiguous(x)
    batch, channels, length = x.shape
    if residual is not None:
        residual = _time_contiguous(residual)
    out = torch.empty(batch, channels, length, device=x.device, dtype=x.dtype)
    grid = (batch * channels, triton.cdiv(length, BLOCK))
    with launch_device(x):
        _channel_bias_kernel[grid](
            x,
            x.stride(0),
            x.stride(1),
            bias,
            residual if residual is not None else x,
            *(residual.stride()[:2] if residual is not None else (0, 0)),
            out,
            channels,
            length,
            HAS_RESIDUAL=residual is not None,
            BLOCK=BLOCK,
        )
    return out


@register_check("snake")
def check_snake(device: torch.device) -> list[Comparison]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=generator)
    log_alpha, log_beta, bias = (torch.randn(3, generator=generator) * 0.5 for _ in range(3))
    history = torch.randn(2, 3, 6, generator=generator)
    on = [t.to(device) for t in (x, log_alpha, log_beta, bias, history)]
    return [
        (
            snake_triton(*on, tail=3),
            snake_reference(x, log_alpha, log_beta, bias, history, tail=3),
            HARDWARE_SINE_TOLERANCE,
        )
    ]


@register_check("channel_bias")
def check_channel_bias(device: torch.device) -> list[Comparison]:
    generator = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator)
    bias = torch.randn(3, generator=generator)
    return [
        (
            add_channel_bias_triton(x.to(device), bias.to(device), residual.to(device)),
            add_channel_bias_reference(x, bias, residual),
            1e-5,
        )
    ]


if triton is not None:

    @triton.jit
    def _snake_kernel(
        x_ptr,
        x_batch_stride,
        x_channel_stride,
        length,
        history_ptr,
        history_batch_stride,
        history_channel_stride,
        history_length,
        log_alpha_ptr,
        log_beta_ptr,
        bias_ptr,
        out_ptr,
        channels,
        tail,
        HAS_BIAS: tl.constexpr,
        HARDWARE_SINE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program: BLOCK output columns of one (batch, channel) row: history, then x, then zeros.
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2**31 at large batches
        batch, channel = row // channels, row % channels
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        width = history_length + length + tail
        from_history = columns < history_length
        from_x = (columns >= history_length) & (columns < history_length + length)
        past = tl.load(
            history_ptr + batch * history_batch_stride + channel * history_channel_stride + columns,
            mask=from_history,
            other=0.0,
        )
        value = tl.load(
            x_ptr + batch * x_batch_stride + channel * x_channel_stride + (columns - history_length),
            mask=from_x,
            other=0.0,
        ).to(tl.float32)
        out_type = out_ptr.dtype.element_ty
        # The parameters are rounded to the activation's dtype, as the reference formula rounds them.
        alpha = tl.exp(tl.load(log_alpha_ptr + channel).to(tl.float32)).to(out_type).to(tl.float32)
        inverse_beta = (
            (1.0 / (tl.exp(tl.load(log_beta_ptr + channel).to(tl.float32)) + 1e-9))
            .to(out_type)
            .to(tl.float32)
        )
        if HAS_BIAS:
            value += tl.load(bias_ptr + channel).to(tl.float32)
        # The GPU's approximate sine keeps this pass memory-bound (the accurate one's range reduction
        # does not); its ~1e-6 error is far below bf16 rounding. Triton's interpreter lacks it.
        if HARDWARE_SINE:
            wave = libdevice.fast_sinf(value * alpha)
        else:
            wave = tl.sin(value * alpha)
        result = tl.where(
            from_history, past.to(tl.float32), tl.where(from_x, value + inverse_beta * wave * wave, 0.0)
        )
        tl.store(out_ptr + row * width + columns, result.to(out_type), mask=columns < width)

    @triton.jit
    def _channel_bias_kernel(
        x_ptr,
        x_batch_stride,
        x_channel_stride,
        bias_ptr,
        residual_ptr,
        residual_batch_stride,
        residual_channel_stride,
        out_ptr,
        channels,
        length,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        batch, channel = row // channels, row % channels
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < length
        value = tl.load(
            x_ptr + batch * x_batch_stride + channel * x_channel_stride + columns, mask=inside, other=0.0
        ).to(tl.float32)
        value += tl.load(bias_ptr + channel).to(tl.float32)
        if HAS_RESIDUAL:
            value += tl.load(
                residual_ptr + batch * residual_batch_stride + channel * residual_channel_stride + columns,
                mask=inside,
                other=0.0,
            ).to(tl.float32)
        tl.store(out_ptr + row * length + columns, value.to(out_ptr.dtype.element_ty), mask=inside)
