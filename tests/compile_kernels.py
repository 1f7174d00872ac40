"""Compile every Triton kernel for a GPU architecture, without a GPU: `python tests/compile_kernels.py
CAPABILITY OUT.json [--dependent-launches]` writes {"errors": {kernel check name: error or null},
"shared": {kernel: the most shared memory a compiled variant of it takes per program, bytes}}.

Triton's interpreter (which the kernel tests use where there is no GPU) accepts code that its GPU
compiler refuses, so a kernel can pass every CPU test and fail its startup check on a GPU, where its
slower formula then serves. Here each registered startup check runs with its inputs on the CPU
while Triton compiles each launch for the named compute capability through the same passes and
`ptxas` as on a GPU, and launches nothing (the outputs are left unwritten and not compared; the
shared memory a kernel takes, which Triton checks against the GPU only when it loads a kernel, is
reported instead).
`--dependent-launches` compiles every kernel that takes a `PDL` constant as a programmatic dependent.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: the kernels are compiled, not interpreted

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CompileOnlyDriver:
    """What Triton asks of its driver to compile a launch: the target, a device and a stream."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("capability", type=int, help="compute capability as major * 10 + minor, e.g. 90")
    parser.add_argument("out", help="where the JSON report goes (Triton prints compiler errors to stdout)")
    parser.add_argument("--dependent-launches", action="store_true")
    args = parser.parse_args()

    driver.set_active(CompileOnlyDriver(args.capability))
    shared: dict[str, int] = {}
    launch = JITFunction.run

    def compile_only(self, *arguments, grid, warmup, **options):
        kernel = launch(self, *arguments, grid=grid, warmup=True, **options)  # warmup: compile, no launch
        shared[self.__name__] = max(shared.get(self.__name__, 0), kernel.metadata.shared)
        return kernel

    JITFunction.run = compile_only

    import voxtriton.kernels as kernels
    from voxtriton.kernels.registry import KERNEL_CHECKS

    if args.dependent_launches:
        for module in pkgutil.iter_modules(kernels.__path__):
            module = importlib.import_module(f"{kernels.__name__}.{module.name}")
            if hasattr(module, "launch_options"):
                module.launch_options = lambda pdl: {"PDL": True, "launch_pdl": True}

    errors = {}
    for name, check in KERNEL_CHECKS.items():
        try:
            check(torch.device("cpu"))
            errors[name] = None
        except Exception as error:  # reported per check: one kernel's failure hides no other's
            errors[name] = f"{type(error).__name__}: {error}"[:2000]
    with open(args.out, "w") as out:
        json.dump({"errors": errors, "shared": shared}, out)


if __name__ == "__main__":
    main()
