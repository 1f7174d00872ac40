"""Fused elementwise kernels of the codec decoder's convolution stack (Triton on CUDA, PyTorch elsewhere).

The decoder's activations are long ([batch, channels, frames * up to 1920]); at a background batch
of 128 x 25 frames one activation is over a gigabyte. Eager PyTorch passed over each one several
times per layer: SnakeBeta's five operations, the convolution bias (a broadcast add on the slow,
non-vectorised path), the causal padding (a concatenation with the carried state) and the residual
add. On the H200 those passes were about 60% of a codec call. Here they become two kernels:

- `snake`: SnakeBeta of (x + the previous convolution's bias), written after the causal history the
  next convolution needs, so the padded input comes out of the same pass;
- `add_channel_bias`: a convolution's bias (+ the residual), into a contiguous tensor;
- `snake_pointwise`: the second half of a residual unit, SnakeBeta of the dilated convolution's
  output then the kernel-size-1 convolution, its bias and the residual, in one pass: the SnakeBeta
  output and the matrix product's never reach memory.

Both compute in fp32. The Triton versions run for CUDA tensors; the reference formulas below run
everywhere else and are what the kernels are tested against.
"""

from __future__ import annotations

import torch

from . import launch_device, triton, triton_usable

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

BLOCK = 1024
POINTWISE_BLOCK_TIME = 128
# How far the fp32 snake on a GPU may differ from the reference: the hardware sine's ~1e-6 error,
# scaled by 1/beta and doubled by the square.
HARDWARE_SINE_TOLERANCE = 1e-4


def snake_reference(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor,
                    bias: torch.Tensor | None = None, history: torch.Tensor | None = None,
                    tail: int = 0) -> torch.Tensor:
    """x + bias -> y + sin(alpha y)^2 / beta per channel, with the checkpoint's log-scale alpha and beta
    (rounded to x's dtype), prefixed along time by `history` [B, C, H] as it is and followed by `tail`
    zero columns."""
    alpha = torch.exp(log_alpha.float()).to(x.dtype)[:, None]
    inverse_beta = (1.0 / (torch.exp(log_beta.float()) + 1e-9)).to(x.dtype)[:, None]
    if bias is not None:
        x = x + bias.to(x.dtype)[:, None]
    y = x + inverse_beta * torch.pow(torch.sin(x * alpha), 2)
    parts = ([] if history is None else [history]) + [y] + ([y.new_zeros(*y.shape[:-1], tail)] if tail else [])
    return torch.cat(parts, dim=-1) if len(parts) > 1 else y


def add_channel_bias_reference(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    out = x + bias.to(x.dtype)[:, None]
    return out if residual is None else out + residual


def snake_pointwise_reference(x, x_bias, log_alpha, log_beta, weight, bias, residual):
    """residual + bias + weight @ SnakeBeta(x + x_bias): x [B, Cin, T], weight [Cout, Cin]."""
    activation = snake_reference(x, log_alpha, log_beta, x_bias)
    return add_channel_bias_reference(torch.matmul(weight.to(x.dtype), activation), bias, residual)


def snake_pointwise(x, x_bias, log_alpha, log_beta, weight, bias, residual):
    """See `snake_pointwise_reference`."""
    if triton_usable(x.device, "snake_pointwise"):
        return snake_pointwise_triton(x, x_bias, log_alpha, log_beta, weight, bias, residual)
    return snake_pointwise_reference(x, x_bias, log_alpha, log_beta, weight, bias, residual)


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
            x, x.stride(0), x.stride(1), length,
            history if history is not None else x, *(history.stride()[:2] if history is not None else (0, 0)),
            history_length, log_alpha, log_beta, bias if bias is not None else log_alpha, out, channels, tail,
            HAS_BIAS=bias is not None, HARDWARE_SINE=x.is_cuda, BLOCK=BLOCK)
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
            x, x.stride(0), x.stride(1), bias,
            residual if residual is not None else x, *(residual.stride()[:2] if residual is not None else (0, 0)),
            out, channels, length, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK)
    return out


def snake_pointwise_triton(x, x_bias, log_alpha, log_beta, weight, bias, residual):
    x, residual = _time_contiguous(x), _time_contiguous(residual)
    batch, in_channels, length = x.shape
    out_channels = weight.shape[0]
    weight = weight.contiguous()
    out = torch.empty(batch, out_channels, length, device=x.device, dtype=x.dtype)
    block_out = min(128, max(16, triton.next_power_of_2(out_channels)))
    grid = (batch * triton.cdiv(length, POINTWISE_BLOCK_TIME), triton.cdiv(out_channels, block_out))
    with launch_device(x):
        _snake_pointwise_kernel[grid](
            x, x.stride(0), x.stride(1), x_bias, log_alpha, log_beta, weight, bias,
            residual, residual.stride(0), residual.stride(1), out, in_channels, out_channels, length,
            BLOCK_OUT=block_out, BLOCK_IN=32, BLOCK_TIME=POINTWISE_BLOCK_TIME,
            # fp32 stays fp32 (tl.dot would round fp32 inputs to tf32).
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", HARDWARE_SINE=x.is_cuda,
            num_warps=8 if block_out * POINTWISE_BLOCK_TIME >= 128 * 128 else 4)
    return out


if triton is not None:
    @triton.jit
    def _snake_pointwise_kernel(x_ptr, x_batch_stride, x_channel_stride, x_bias_ptr, log_alpha_ptr, log_beta_ptr,
                                weight_ptr, bias_ptr, residual_ptr, residual_batch_stride, residual_channel_stride,
                                out_ptr, in_channels, out_channels, length,
                                BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_TIME: tl.constexpr,
                                PRECISION: tl.constexpr, HARDWARE_SINE: tl.constexpr):
        # One program: BLOCK_OUT output channels x BLOCK_TIME columns of one batch row. The input
        # channels go by in blocks of BLOCK_IN: SnakeBeta in fp32 on each [BLOCK_IN, BLOCK_TIME]
        # tile as it is loaded, rounded to the activation's dtype as the unfused pass stores it, then
        # one matrix product into the fp32 accumulator.
        time_blocks = tl.cdiv(length, BLOCK_TIME)
        batch = (tl.program_id(0) // time_blocks).to(tl.int64)
        columns = (tl.program_id(0) % time_blocks) * BLOCK_TIME + tl.arange(0, BLOCK_TIME)
        outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        in_time, in_out = columns < length, outs < out_channels
        act_type = out_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_OUT, BLOCK_TIME), dtype=tl.float32)
        for start in range(0, in_channels, BLOCK_IN):
            ins = start + tl.arange(0, BLOCK_IN)
            in_in = ins < in_channels
            value = tl.load(x_ptr + batch * x_batch_stride + ins[:, None] * x_channel_stride + columns[None, :],
                            mask=in_in[:, None] & in_time[None, :], other=0.0).to(tl.float32)
            value += tl.load(x_bias_ptr + ins, mask=in_in, other=0.0).to(tl.float32)[:, None]
            alpha = tl.exp(tl.load(log_alpha_ptr + ins, mask=in_in, other=0.0).to(tl.float32)).to(act_type).to(tl.float32)
            inverse_beta = (1.0 / (tl.exp(tl.load(log_beta_ptr + ins, mask=in_in, other=0.0).to(tl.float32)) + 1e-9)
                            ).to(act_type).to(tl.float32)
            if HARDWARE_SINE:  # see _snake_kernel
                wave = libdevice.fast_sinf(value * alpha[:, None])
            else:
                wave = tl.sin(value * alpha[:, None])
            activation = (value + inverse_beta[:, None] * wave * wave).to(act_type)
            weight = tl.load(weight_ptr + outs[:, None] * in_channels + ins[None, :],
                             mask=in_out[:, None] & in_in[None, :], other=0.0).to(act_type)
            acc = tl.dot(weight, activation, acc, input_precision=PRECISION)
        acc += tl.load(bias_ptr + outs, mask=in_out, other=0.0).to(tl.float32)[:, None]
        inside = in_out[:, None] & in_time[None, :]
        acc += tl.load(residual_ptr + batch * residual_batch_stride + outs[:, None] * residual_channel_stride
                       + columns[None, :], mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + batch * out_channels * length + outs[:, None] * length + columns[None, :],
                 acc.to(act_type), mask=inside)

    @triton.jit
    def _snake_kernel(x_ptr, x_batch_stride, x_channel_stride, length,
                      history_ptr, history_batch_stride, history_channel_stride, history_length,
                      log_alpha_ptr, log_beta_ptr, bias_ptr, out_ptr, channels, tail,
                      HAS_BIAS: tl.constexpr, HARDWARE_SINE: tl.constexpr, BLOCK: tl.constexpr):
        # One program: BLOCK output columns of one (batch, channel) row: history, then x, then zeros.
        row = tl.program_id(0).to(tl.int64)  # row * width passes 2**31 at large batches
        batch, channel = row // channels, row % channels
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        width = history_length + length + tail
        from_history = columns < history_length
        from_x = (columns >= history_length) & (columns < history_length + length)
        past = tl.load(history_ptr + batch * history_batch_stride + channel * history_channel_stride + columns,
                       mask=from_history, other=0.0)
        value = tl.load(x_ptr + batch * x_batch_stride + channel * x_channel_stride + (columns - history_length),
                        mask=from_x, other=0.0).to(tl.float32)
        out_type = out_ptr.dtype.element_ty
        # The parameters are rounded to the activation's dtype, as the reference formula rounds them.
        alpha = tl.exp(tl.load(log_alpha_ptr + channel).to(tl.float32)).to(out_type).to(tl.float32)
        inverse_beta = (1.0 / (tl.exp(tl.load(log_beta_ptr + channel).to(tl.float32)) + 1e-9)).to(out_type).to(tl.float32)
        if HAS_BIAS:
            value += tl.load(bias_ptr + channel).to(tl.float32)
        # On a GPU, the hardware's approximate sine (one MUFU instruction): the accurate one's range
        # reduction made this pass compute-bound, at about 2 TB/s on the H200. Its error (~1e-6
        # absolute) is far below the bf16 activations' rounding. Triton's interpreter lacks it.
        if HARDWARE_SINE:
            wave = libdevice.fast_sinf(value * alpha)
        else:
            wave = tl.sin(value * alpha)
        result = tl.where(from_history, past.to(tl.float32), tl.where(from_x, value + inverse_beta * wave * wave, 0.0))
        tl.store(out_ptr + row * width + columns, result.to(out_type), mask=columns < width)

    @triton.jit
    def _channel_bias_kernel(x_ptr, x_batch_stride, x_channel_stride, bias_ptr,
                             residual_ptr, residual_batch_stride, residual_channel_stride,
                             out_ptr, channels, length, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        batch, channel = row // channels, row % channels
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < length
        value = tl.load(x_ptr + batch * x_batch_stride + channel * x_channel_stride + columns,
                        mask=inside, other=0.0).to(tl.float32)
        value += tl.load(bias_ptr + channel).to(tl.float32)
        if HAS_RESIDUAL:
            value += tl.load(residual_ptr + batch * residual_batch_stride + channel * residual_channel_stride + columns,
                             mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * length + columns, value.to(out_ptr.dtype.element_ty), mask=inside)
