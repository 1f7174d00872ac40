"""Triton kernels of the GPU path. Each has a PyTorch reference formula, which is what runs on other
devices and what the kernel is tested against (in Triton's interpreter where there is no GPU)."""

from __future__ import annotations

import logging

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the reference formulas serve
    triton = None

log = logging.getLogger(__name__)
_usable: dict[int, bool] = {}


def launch_device(tensor: torch.Tensor) -> torch.cuda.device:
    """Context for launching a kernel on `tensor`: Triton launches on the current CUDA device, which
    need not be the tensor's (a codec on the second GPU). -1 leaves it alone: CPU tensors in Triton's
    interpreter."""
    return torch.cuda.device(tensor.device if tensor.is_cuda else -1)


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run on this CUDA device, decided once per device by running each of
    them on small inputs against its reference formula.

    CUDA builds of torch bring Triton, but Triton builds each kernel's launcher with the system's C
    compiler and Python headers at first use, which slim images lack, and bf16 matrix products need
    compute capability 8.0. Where the check fails, the reference formulas run (slower) and a warning
    says why. The model and codec runners call this when they are made, before any graph capture.
    """
    if triton is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _usable:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the Triton kernel check must run before CUDA graph capture: call "
                               "voxtriton.kernels.triton_usable(device) first")
        try:
            _check_kernels(torch.device("cuda", index))
            _usable[index] = True
        except Exception as error:  # a missing compiler or headers surfaces here as a compile error
            log.warning("Triton kernels unavailable on cuda:%d (%s: %s); using the slower PyTorch formulas",
                        index, type(error).__name__, error)
            _usable[index] = False
    return _usable[index]


def _check_kernels(device: torch.device) -> None:
    from .attention import decode_attention, decode_attention_reference
    from .codec import add_channel_bias_reference, add_channel_bias_triton, snake_reference, snake_triton

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=generator)
    bias, log_alpha, log_beta = (torch.randn(3, generator=generator) * 0.5 for _ in range(3))
    history = torch.randn(2, 3, 6, generator=generator)
    cases = [("snake", snake_triton(x.to(device), log_alpha.to(device), log_beta.to(device), bias.to(device), history.to(device)),
              snake_reference(x, log_alpha, log_beta, bias, history), 1e-5),
             ("channel bias", add_channel_bias_triton(x.to(device), bias.to(device), x.to(device)),
              add_channel_bias_reference(x, bias, x), 1e-5)]
    positions = torch.tensor([[5], [70]])
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        q = torch.randn(2, 4, 1, 128, generator=generator).to(dtype)
        keys, values = (torch.randn(2, 2, 80, 128, generator=generator).to(dtype) for _ in range(2))
        out = decode_attention(q.to(device), keys.to(device), values.to(device), positions.to(device), 0.1)
        cases.append((f"decode attention ({dtype})", out, decode_attention_reference(q, keys, values, positions, 0.1),
                      tolerance))
    from .rotary import rotate_into_cache, rotate_into_cache_triton

    qkv = torch.randn(2, 1, 4, 8, generator=generator)  # 2 query heads, 1 KV head, head size 8
    rotary = [torch.randn(2, 1, 1, 8, generator=generator) for _ in range(2)]
    norms = [torch.rand(8, generator=generator) + 0.5 for _ in range(2)]
    positions = torch.tensor([[1], [4]])
    caches = torch.zeros(2, 2, 1, 6, 8)
    inputs = [qkv, *norms, *rotary, caches, positions]
    qkv_, q_norm, k_norm, cos, sin, caches_, positions_ = (t.to(device) for t in inputs)
    q = rotate_into_cache_triton(qkv_, 2, 1, q_norm, k_norm, 1e-6, cos, sin, caches_[0], caches_[1], positions_)
    q_reference = rotate_into_cache(qkv, 2, 1, *norms, 1e-6, *rotary, caches[0], caches[1], positions)
    cases.append(("rotary and cache write", torch.cat((q.flatten(), caches_.flatten())),
                  torch.cat((q_reference.flatten(), caches.flatten())), 1e-5))
    from ..engine.sampling import RowParams, sample
    from .sampling import sample_triton

    logits = torch.randn(4, 300, generator=generator) * 3
    keys = torch.tensor([5, 2**31 - 1, 0, 123456789])
    params = RowParams(torch.tensor([0.0, 0.9, 1.3, 0.7]), torch.tensor([0, 50, 0, 3]), torch.tensor([1.0, 1.0, 0.8, 1.0]),
                       torch.zeros(4, dtype=torch.long))
    on_device = [t.to(device) for t in (logits, params.temperature, params.top_k, params.top_p, keys)]
    cases.append(("sampling", sample_triton(*on_device), sample(logits, params, keys), 0))
    from .norm import add_rms_norm_reference, add_rms_norm_triton, silu_and_mul_reference, silu_and_mul_triton

    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator)
    weight = torch.rand(40, generator=generator) + 0.5
    normed, summed = add_rms_norm_triton(x.to(device), residual.to(device), weight.to(device), 1e-6)
    normed_reference, summed_reference = add_rms_norm_reference(x, residual, weight, 1e-6)
    cases.append(("residual add and RMS norm", torch.cat((normed.flatten(), summed.flatten())),
                  torch.cat((normed_reference.flatten(), summed_reference.flatten())), 1e-5))
    gate_up = torch.randn(2, 3, 80, generator=generator) * 3
    cases.append(("SiLU and product", silu_and_mul_triton(gate_up.to(device)), silu_and_mul_reference(gate_up), 1e-5))
    for name, result, expected, tolerance in cases:
        if not torch.allclose(result.float().cpu(), expected.float(), rtol=tolerance, atol=tolerance):
            raise RuntimeError(f"{name} kernel disagrees with its reference formula")
