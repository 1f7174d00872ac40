"""Each Triton kernel run once on small inputs against its reference formula: what decides, per
device and per kernel, whether the kernel or the formula serves (`voxtriton.kernels.triton_usable`).

A check returns (kernel output, reference output, tolerance) pairs; the inputs live on the CPU and
are moved to the device under test, so the references run where they always run.
"""

from __future__ import annotations

from typing import Callable

import torch

Comparison = tuple[torch.Tensor, torch.Tensor, float]


def check_snake(device: torch.device) -> list[Comparison]:
    from .codec import HARDWARE_SINE_TOLERANCE, snake_reference, snake_triton

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


def check_channel_bias(device: torch.device) -> list[Comparison]:
    from .codec import add_channel_bias_reference, add_channel_bias_triton

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


def check_decode_attention(device: torch.device) -> list[Comparison]:
    from .attention import decode_attention, decode_attention_reference

    generator = torch.Generator().manual_seed(2)
    comparisons = []
    # A talker-like span and the code predictor's 16 entries: they launch with different shapes
    # (`attention.launch_shape`). Either failing sends every decode-attention call to the reference.
    for span, positions in ((80, torch.tensor([[5], [70]])), (16, torch.tensor([[3], [15]]))):
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            q = torch.randn(2, 4, 1, 128, generator=generator).to(dtype)
            keys, values = (torch.randn(2, 2, span, 128, generator=generator).to(dtype) for _ in range(2))
            out = decode_attention(
                q.to(device), keys.to(device), values.to(device), positions.to(device), 0.1
            )
            comparisons.append((out, decode_attention_reference(q, keys, values, positions, 0.1), tolerance))
    return comparisons


def check_rotary(device: torch.device) -> list[Comparison]:
    from .rotary import rotate_into_cache, rotate_into_cache_triton

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


def check_sampling(device: torch.device) -> list[Comparison]:
    from ..engine.sampling import RowParams, sample
    from .sampling import sample_triton

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4)) * 3
    keys = torch.tensor([5, 2**31 - 1, 0, 123456789])
    params = RowParams(
        torch.tensor([0.0, 0.9, 1.3, 0.7]),
        torch.tensor([0, 50, 0, 3]),
        torch.tensor([1.0, 1.0, 0.8, 1.0]),
        torch.zeros(4, dtype=torch.long),
    )
    on = [t.to(device) for t in (logits, params.temperature, params.top_k, params.top_p, keys)]
    return [(sample_triton(*on), sample(logits, params, keys), 0)]


def check_add_rms_norm(device: torch.device) -> list[Comparison]:
    from .norm import add_rms_norm_reference, add_rms_norm_triton

    generator = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator)
    weight = torch.rand(40, generator=generator) + 0.5
    normed, summed = add_rms_norm_triton(x.to(device), residual.to(device), weight.to(device), 1e-6)
    normed_reference, summed_reference = add_rms_norm_reference(x, residual, weight, 1e-6)
    return [(normed, normed_reference, 1e-5), (summed, summed_reference, 1e-5)]


def check_silu_and_mul(device: torch.device) -> list[Comparison]:
    from .norm import silu_and_mul_reference, silu_and_mul_triton

    gate_up = torch.randn(2, 3, 80, generator=torch.Generator().manual_seed(6)) * 3
    return [(silu_and_mul_triton(gate_up.to(device)), silu_and_mul_reference(gate_up), 1e-5)]


KERNEL_CHECKS: dict[str, Callable[[torch.device], list[Comparison]]] = {
    "snake": check_snake,
    "channel_bias": check_channel_bias,
    "decode_attention": check_decode_attention,
    "rotary": check_rotary,
    "sampling": check_sampling,
    "add_rms_norm": check_add_rms_norm,
    "silu_and_mul": check_silu_and_mul,
}
