"""What the kernel modules share: the optional triton import, launching on a tensor's device, and the
startup checks that decide, per device and per kernel, whether the kernel or its formula serves.

Each kernel module registers its check beside its kernel (`register_check`); this module knows no
kernel by name. A check runs the kernel once on small inputs and returns (kernel output, reference
output, tolerance) pairs; its inputs live on the CPU and are moved to the device under test, so the
references run where they always run.

`VOXTRITON_KERNELS_OFF` (comma-separated kernel names) lets those kernels' formulas serve in every
process that reads it, a server's model instances included: to measure a kernel in serving, or to
step around one suspected of a fault without a new build.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import Callable, Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference formulas serve
    triton = None

log = logging.getLogger(__name__)

Comparison = tuple[torch.Tensor, torch.Tensor, float]
Check = Callable[[torch.device], list[Comparison]]
KERNEL_CHECKS: dict[str, Check] = {}  # kernel name -> its startup check, in registration order
_usable: dict[int, dict[str, bool]] = {}  # per CUDA device index: kernel name -> runs there
_plain_launches = contextvars.ContextVar("plain_launches", default=False)  # see `plain_launches`

# A kernel that falls back says so in this form (benchmarks/serving_bench.py finds these lines by it).
FALLBACK_WARNING = "Triton kernel %s unavailable on %s (%s: %s); using its slower PyTorch formula"
KERNELS_OFF_VARIABLE = "VOXTRITON_KERNELS_OFF"


def register_check(name: str) -> Callable[[Check], Check]:
    """Decorator: `check(device)` decides whether the Triton kernel `name` serves on a device."""

    def register(check: Check) -> Check:
        if name in KERNEL_CHECKS:
            raise ValueError(f"a Triton kernel named {name!r} is registered twice")
        KERNEL_CHECKS[name] = check
        return check

    return register


def launch_device(tensor: torch.Tensor) -> torch.cuda.device:
    """Context for launching a kernel on `tensor`: Triton launches on the current CUDA device, which
    need not be the tensor's (a codec on the second GPU). -1 leaves it alone: CPU tensors in Triton's
    interpreter."""
    return torch.cuda.device(tensor.device if tensor.is_cuda else -1)


def programmatic_launch(device: torch.device) -> bool:
    """Whether the step's kernels launch as programmatic dependents on this device (Hopper and newer,
    checked at start as `programmatic_launch`): each may start while the kernel before it runs, and
    waits for it before it reads its inputs or stores anything (`await_inputs`). At one row a frame
    step is about a thousand short kernels in a row, and each would otherwise start only once the
    last had ended. Never inside `plain_launches`."""
    return not _plain_launches.get() and triton_usable(device, "programmatic_launch")


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Within (this thread or task): every kernel launches plainly, also into a graph captured there.
    The codec runs so: its calls gained nothing from dependent launches (on one H100 host a call of 8
    chunks of 2 frames took 2.52 ms with them against 2.36 without; on another, 2.51 without:
    benchmarks/results/programmatic_launch_h100.md)."""
    token = _plain_launches.set(True)
    try:
        yield
    finally:
        _plain_launches.reset(token)


def launch_options(pdl: bool) -> dict:
    """A kernel's launch arguments for its `PDL` constant: a programmatic dependent launch or a plain one."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def triton_usable(device: torch.device, kernel: str) -> bool:
    """Whether the Triton kernel `kernel` (a registered name) runs on this device; see `check_kernels`."""
    if kernel not in KERNEL_CHECKS:  # checked everywhere, so that CPU runs catch a misspelt name too
        raise KeyError(f"no Triton kernel named {kernel!r}; known: {sorted(KERNEL_CHECKS)}")
    if triton is None or device.type != "cuda":
        return False
    return check_kernels(device)[kernel]


def check_kernels(device: torch.device) -> dict[str, bool]:
    """Which Triton kernels run on this CUDA device, decided once per device by running each registered
    check; each kernel that fails falls back to its formula alone.

    CUDA builds of torch bring Triton, but Triton builds each kernel's launcher with the system's C
    compiler and Python headers at first use, which slim images lack, and bf16 matrix products need
    compute capability 8.0. Where a check fails, that kernel's reference formula runs (slower) and a
    warning says why. The model and codec runners call this when they are made, before any graph
    capture.
    """
    if device.type != "cuda" or triton is None:
        kernels_turned_off()  # a misspelt name is refused on every device
    if device.type != "cuda":
        return dict.fromkeys(KERNEL_CHECKS, False)
    if triton is None:  # said per kernel, as a failed check is: benchmarks look for these lines
        for name in KERNEL_CHECKS:
            log.warning(
                FALLBACK_WARNING, name, device, "ImportError", "the triton package cannot be imported"
            )
        return dict.fromkeys(KERNEL_CHECKS, False)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _usable:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the Triton kernel check must run before CUDA graph capture: call "
                "voxtriton.kernels.check_kernels(device) first"
            )
        off = kernels_turned_off()  # read once per device: `triton_usable` lands here on every dispatch
        checks = {name: check for name, check in KERNEL_CHECKS.items() if name not in off}
        _usable[index] = dict.fromkeys(off, False) | run_checks(torch.device("cuda", index), checks)
        if off:
            log.warning("Triton kernels %s turned off by %s", sorted(off), KERNELS_OFF_VARIABLE)
    return _usable[index]


def kernels_turned_off() -> set[str]:
    """The kernel names in `VOXTRITON_KERNELS_OFF`; a name no kernel has is refused, naming it."""
    names = {name.strip() for name in os.environ.get(KERNELS_OFF_VARIABLE, "").split(",") if name.strip()}
    _check_names(names, KERNELS_OFF_VARIABLE)
    return names


def turn_off(device: torch.device, names: list[str]) -> None:
    """Let the formulas of the Triton kernels `names` serve on a CUDA device from now on (benchmarks
    measure a kernel against its formula this way). Call before the runners are made."""
    _check_names(set(names), "turn_off")
    if device.type == "cuda":
        check_kernels(device).update(dict.fromkeys(names, False))


def _check_names(names: set[str], source: str) -> None:
    unknown = sorted(names - set(KERNEL_CHECKS))
    if unknown:
        raise KeyError(f"{source}: no Triton kernel named {unknown}; known: {sorted(KERNEL_CHECKS)}")


if triton is not None:

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """A kernel's first step under a programmatic dependent launch (`launch_options`): let the next
        kernel start, then wait until the kernels before this one are done and their writes visible."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()


def run_checks(device: torch.device, checks: dict[str, Check]) -> dict[str, bool]:
    """Run each check (name -> function of the device returning (kernel output, reference output,
    tolerance) pairs); a kernel passes when it runs and every pair agrees."""
    usable = {}
    for name, check in checks.items():
        try:
            for result, expected, tolerance in check(device):
                if not torch.allclose(result.float().cpu(), expected.float(), rtol=tolerance, atol=tolerance):
                    raise RuntimeError("it disagrees with its reference formula")
            usable[name] = True
        except Exception as error:  # a missing compiler or headers surfaces here as a compile error
            log.warning(FALLBACK_WARNING, name, device, type(error).__name__, error)
            usable[name] = False
    return usable
