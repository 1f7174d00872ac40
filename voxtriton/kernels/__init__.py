"""Triton kernels of the GPU path. Each has a PyTorch reference formula, which is what runs on other
devices and what the kernel is tested against (in Triton's interpreter where there is no GPU)."""

try:
    import triton
except ImportError:  # CPU-only installs: the reference formulas serve
    triton = None
