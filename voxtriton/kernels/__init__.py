"""Triton kernels of the GPU path. Each has a PyTorch reference formula, which is what runs on other
devices and what the kernel is tested against (in Triton's interpreter where there is no GPU).

Importing the package imports every kernel module, so that each registers its startup check before
`check_kernels` runs them (`registry`).
"""

from . import attention, codec, fp8, linear, norm, rotary, sampling
from .registry import (
    FALLBACK_WARNING,
    check_kernels,
    plain_launches,
    programmatic_launch,
    run_checks,
    triton_usable,
    turn_off,
)

__all__ = [
    "FALLBACK_WARNING",
    "attention",
    "check_kernels",
    "codec",
    "fp8",
    "linear",
    "norm",
    "plain_launches",
    "programmatic_launch",
    "rotary",
    "run_checks",
    "sampling",
    "triton_usable",
    "turn_off",
]
