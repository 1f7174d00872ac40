"""Matrix products of one row: a decode step of one stream.

At one row a projection only streams its weight matrix, and a frame step makes about 430 of them
(the talker's 28 layers, the predictor's 5 layers 15 times, their heads). cuBLAS splits the smaller
of these products over K and reduces the parts in a second kernel. Here one program per few output
columns reads its rows of the weight once, in long contiguous runs, with no second kernel: the 1.7B
frame step of one row takes 4.96 ms instead of 5.66 on an H100 (`model_speed.py`, results in
benchmarks/results/one_row_linear_h100.md). From two rows on cuBLAS serves: a tensor-core kernel
for 2-16 rows made the frame step slower.

The kernel accumulates in fp32 and rounds once, as cuBLAS does, in another order: results differ
from `F.linear` in the last bit at most.

`linear_silu_and_mul` is a gated MLP's gate/up projection and its SiLU product in one launch: a
program reads a few gate rows and the matching up rows of the weight and writes silu(gate) * up,
rounded where `norm.silu_and_mul` rounds, so a layer's MLP makes two launches instead of three.

Launched as programmatic dependents (`registry.programmatic_launch`), both read their first block of
weights (written by no kernel of the step) while the kernel before them still runs, and only then
wait for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import add_rms_norm_reference, add_rms_norm_triton, silu_and_mul
from .registry import (
    Comparison,
    launch_device,
    launch_options,
    programmatic_launch,
    register_check,
    triton,
    triton_usable,
)
from .sampling import sample_reference, sample_triton

if triton is not None:
    import triton.language as tl

# (output columns, input columns) per step of a program: each weight row is read in 1 KiB runs; the
# wide matrices (gate/up) take twice the columns per program, so fewer programs queue.
BLOCKS = {"narrow": (4, 512), "wide": (8, 512)}
WIDE_OUTPUT = 6144


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; in this module's kernel for one row of bf16 or fp16 x on GPUs
    that run it. x [..., K], weight [N, K], bias [N] or None."""
    if _takes_the_kernel(x, weight, bias):
        return linear_triton(x, weight, bias, pdl=programmatic_launch(x.device))
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(linear(x, weight))`: weight [2I, K] holds the gate rows, then the up rows; returns
    silu(gate) * up [..., I]. One launch for one row of bf16 or fp16 x on GPUs that run the kernel."""
    if _takes_the_kernel(x, weight, None):
        return linear_triton(x, weight, None, gated=True, pdl=programmatic_launch(x.device))
    return silu_and_mul(linear(x, weight))


def _takes_the_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.numel() == x.shape[-1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and weight.stride(-1) == 1
        and (bias is None or bias.dtype == x.dtype)
        and triton_usable(x.device, "one_row_linear")
    )


def linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False, pdl: bool = False
) -> torch.Tensor:
    """One row of x [..., K] (every other dimension 1) times weight [N, K] with unit stride in K; `gated`:
    silu(gate) * up of the product's halves (N/2 columns out); `pdl`: a programmatic dependent launch
    (compute capability 9.0+)."""
    rows, width = weight.shape
    if x.numel() != width or x.shape[-1] != width or weight.stride(-1) != 1:
        raise ValueError(f"linear: one row of {width} and a weight [{rows}, {width}] with unit stride")
    if gated and (rows % 2 or bias is not None):
        raise ValueError(f"linear: a gated product needs an even number of weight rows and no bias: {rows}")
    row = x.reshape(width)
    if row.stride(0) != 1:
        row = row.contiguous()
    out_columns = rows // 2 if gated else rows
    out = torch.empty(out_columns, dtype=x.dtype, device=x.device)
    block_n, block_k = BLOCKS["wide" if rows >= WIDE_OUTPUT else "narrow"]
    if gated:  # a program reads block_n weight rows: half of them gate rows, half up rows
        block_n //= 2
    with launch_device(x):
        _one_row_kernel[(triton.cdiv(out_columns, block_n),)](
            row,
            weight,
            weight.stride(0),
            bias if bias is not None else weight,
            out,
            out_columns,
            width,
            HAS_BIAS=bias is not None,
            GATED=gated,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4,
            num_stages=3,
            **launch_options(pdl),
        )
    return out.view(*x.shape[:-1], out_columns)


@register_check("one_row_linear")
def check_linear(device: torch.device) -> list[Comparison]:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise RuntimeError("bf16 matrix products need compute capability 8.0")
    generator = torch.Generator().manual_seed(8)
    checks = []
    # Sizes that are multiples of 16 (compiled with vector loads, as every model's are), in both
    # blocks, and sizes off every block multiple (the masks).
    for out_columns, width in ((64, 1024), (WIDE_OUTPUT, 512), (70, 600)):
        weight = (torch.randn(out_columns, width, generator=generator) / width**0.5).bfloat16()
        x = torch.randn(1, width, generator=generator).bfloat16()
        for bias in (None, torch.randn(out_columns, generator=generator).bfloat16()):
            result = linear_triton(x.to(device), weight.to(device), None if bias is None else bias.to(device))
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            checks.append((result, expected, 2e-2))
        gated = linear_triton(x.to(device), weight.to(device), None, gated=True)
        checks.append((gated, silu_and_mul(F.linear(x.float(), weight.float())), 2e-2))
    return checks


@register_check("programmatic_launch")
def check_programmatic_launch(device: torch.device) -> list[Comparison]:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        raise RuntimeError("programmatic dependent launch needs compute capability 9.0")
    generator = torch.Generator().manual_seed(9)
    x, residual = (torch.randn(1, 1024, generator=generator).bfloat16() for _ in range(2))
    weight = (torch.randn(2 * 512, 1024, generator=generator) / 32).bfloat16()
    norm_weight = (torch.rand(1024, generator=generator) + 0.5).bfloat16()
    on = [t.to(device) for t in (x, residual, weight, norm_weight)]
    # A draw from the last projection's 512 outputs as logits: temperature, top-k, top-p, draw key.
    draw = [torch.tensor([0.9]), torch.tensor([50]), torch.tensor([1.0]), torch.tensor([7])]
    draw_on = [t.to(device) for t in draw]  # before any capture: no copies from the host inside one

    def chain():  # each launch reads what the one before it wrote, as a frame step's kernels do
        normed, summed = add_rms_norm_triton(on[0], on[1], on[3], 1e-6, pdl=True)
        gated = linear_triton(normed, on[2], None, gated=True, pdl=True)
        projected = linear_triton(gated, on[2][:, :512], None, pdl=True)
        token = sample_triton(projected, *draw_on, pdl=True)
        return summed, normed, gated, projected, token

    runs = [chain()]
    if device.type == "cuda":  # and replayed from a CUDA graph, as the frame step runs
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        graph.replay()
        runs.append(captured)
    expected_normed, expected_summed = add_rms_norm_reference(
        x.float(), residual.float(), norm_weight.float(), 1e-6
    )
    expected_gated = silu_and_mul(F.linear(expected_normed, weight.float()))
    expected_projected = F.linear(expected_gated, weight.float()[:, :512])
    checks = []
    for summed, normed, gated, projected, token in runs:
        # The draw is checked against the reference's draw from the kernel's own logits.
        drawn = sample_reference(projected.cpu(), *draw)
        checks += [
            (summed, expected_summed, 2e-2),
            (normed, expected_normed, 2e-2),
            (gated, expected_gated, 5e-2),
            (projected, expected_projected, 0.1),
            (token, drawn, 0),
        ]
    return checks


if triton is not None:
    # x's alignment unspecialised: a row cut from a wider tensor (a last position, an admitted row)
    # uses the variant compiled at warm-up whatever its offset; its loads are a few KiB a call.
    @triton.jit(do_not_specialize_on_alignment=["x"])
    def _one_row_kernel(
        x, weight, weight_stride, bias, out, out_columns, width,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # the next kernel may start once every program has
            tl.extra.cuda.gdc_launch_dependents()
        dtype = out.dtype.element_ty
        columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_inside = columns < out_columns
        gate_rows = weight + columns[:, None].to(tl.int64) * weight_stride
        up_rows = gate_rows + out_columns * weight_stride  # read only when GATED
        # Products summed elementwise across the K loop, reduced once at the end.
        total = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        up_total = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # used only when GATED
        first = 0
        if PDL:
            # The first block's weights are read before waiting for the kernel that writes x; nothing
            # is stored before the wait (a kernel before this one may still read `out`'s memory).
            k = tl.arange(0, BLOCK_K)
            k_inside = k < width
            inside = column_inside[:, None] & k_inside[None, :]
            total = tl.load(gate_rows + k[None, :], mask=inside, other=0.0).to(tl.float32)
            if GATED:
                up_total = tl.load(up_rows + k[None, :], mask=inside, other=0.0).to(tl.float32)
            tl.extra.cuda.gdc_wait()
            value = tl.load(x + k, mask=k_inside, other=0.0).to(tl.float32)[None, :]
            total *= value
            if GATED:
                up_total *= value
            first = BLOCK_K
        for start in range(first, width, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_inside = k < width
            inside = column_inside[:, None] & k_inside[None, :]
            value = tl.load(x + k, mask=k_inside, other=0.0).to(tl.float32)[None, :]
            total += tl.load(gate_rows + k[None, :], mask=inside, other=0.0).to(tl.float32) * value
            if GATED:
                up_total += tl.load(up_rows + k[None, :], mask=inside, other=0.0).to(tl.float32) * value
        result = tl.sum(total, axis=1)
        if HAS_BIAS:
            result += tl.load(bias + columns, mask=column_inside, other=0.0).to(tl.float32)
        if GATED:
            # Rounded where the projection's output and `silu_and_mul` round.
            gate = result.to(dtype).to(tl.float32)
            up = tl.sum(up_total, axis=1).to(dtype).to(tl.float32)
            result = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32) * up
        tl.store(out + columns, result.to(dtype), mask=column_inside)
