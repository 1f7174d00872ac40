"""The GPUs a server may use, and the CUDA MPS daemon through which its processes share them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..serving.settings import visible_devices


def pinned_device(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the gpu-th GPU this process may use."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return str(gpu)
    allowed = visible_devices(inherited)
    if not 0 <= gpu < len(allowed):
        raise SystemExit(
            f"voxtriton: GPU {gpu} is not among the {len(allowed)} that "
            f"CUDA_VISIBLE_DEVICES={inherited!r} allows"
        )
    return allowed[gpu]


def gpu_count() -> int:
    """GPUs the server may use: those nvidia-smi lists, limited to CUDA_VISIBLE_DEVICES when it is set."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    present = result.stdout.count("GPU ") if result.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return present if visible is None else min(present, len(visible_devices(visible)))


class MPSDaemon:
    """The CUDA MPS control daemon, with private pipe and log directories, for one server run."""

    def __init__(self, root: Path, pinned: dict[str, str] | None = None):
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(root / "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "mps-log"),
        }
        self.pinned = pinned or {}  # CUDA_VISIBLE_DEVICES of a server pinned to one GPU
        self.started = False

    def start(self) -> None:
        if shutil.which("nvidia-cuda-mps-control") is None:
            print(
                "voxtriton: nvidia-cuda-mps-control not found; codec lanes will time-slice with the backbone"
            )
            return
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["nvidia-cuda-mps-control", "-d"],
            env={**os.environ, **self.env, **self.pinned},
            capture_output=True,
        )
        self.started = result.returncode == 0
        if not self.started:
            print(
                f"voxtriton: could not start CUDA MPS ({result.stderr.decode().strip()}); "
                "lanes will time-slice"
            )

    def stop(self) -> None:
        if self.started:
            subprocess.run(
                ["nvidia-cuda-mps-control"],
                input=b"quit\n",
                env={**os.environ, **self.env},
                capture_output=True,
                timeout=30,
            )
            self.started = False

    def client_environment(self, visible: str | None) -> dict[str, str]:
        """What the server's processes, clients of this daemon, need to reach it and its GPUs."""
        if visible is None or not self.started:
            return dict(self.env)
        # The daemon was started with these devices, and an MPS client numbers the GPUs its MPS
        # server sees from 0: passed on unchanged, CUDA_VISIBLE_DEVICES=1 would name a second GPU
        # that the server does not have, and the models would find no GPU.
        renumbered = ",".join(str(index) for index in range(len(visible_devices(visible))))
        return {**self.env, "CUDA_VISIBLE_DEVICES": renumbered}
