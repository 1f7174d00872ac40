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


def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels run on this CUDA device. CUDA builds of torch bring Triton, but Triton
    builds each kernel's launcher with the system's C compiler and Python headers at first use, and
    slim images lack them. Checked once per device by running a small kernel; where it fails, the
    reference formulas run (slower) and a warning says why. Call it outside CUDA graph capture."""
    if triton is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _usable:
        from .codec import add_channel_bias_reference, add_channel_bias_triton

        try:
            x = torch.arange(6.0, device=device).view(1, 2, 3)
            bias = torch.tensor([1.0, -1.0], device=device)
            _usable[index] = bool(torch.equal(add_channel_bias_triton(x, bias), add_channel_bias_reference(x, bias)))
            if not _usable[index]:
                log.warning("Triton kernel check on cuda:%d gave a wrong result; using the PyTorch formulas", index)
        except Exception as error:  # a missing compiler or headers surfaces as a compile error here
            log.warning("Triton kernels unavailable on cuda:%d (%s); using the slower PyTorch formulas", index, error)
            _usable[index] = False
    return _usable[index]
