"""Process-level setup shared by the Triton models: device, dtype, checkpoint, SM partition."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .settings import default_checkpoint_dir, visible_devices

log = logging.getLogger(__name__)


GPU_DEVICE_NODE = Path("/dev/nvidia0")  # present on a host with an NVIDIA GPU and its driver


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and not visible_devices(visible):
            return torch.device("cpu")  # no GPU wanted ("", "-1"): the CPU was asked for
        if GPU_DEVICE_NODE.exists():
            if torch.version.cuda is not None:
                # A CUDA build that cannot use the host's GPU is misconfigured (CUDA_VISIBLE_DEVICES,
                # MPS): refuse rather than serve a GPU's load at CPU speed.
                raise ValueError(
                    f"config.pbtxt parameter 'device' is auto and this host has a GPU ({GPU_DEVICE_NODE}), "
                    "but CUDA is not available to this process: check CUDA_VISIBLE_DEVICES, the CUDA MPS "
                    "daemon and that the driver supports this torch's CUDA, or set device=cpu for every "
                    "model (voxtriton serve --param '*:device=cpu') to run on the CPU anyway"
                )
            log.warning(
                "this host has a GPU but torch %s is a CPU-only build: running on the CPU", torch.__version__
            )
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


def ensure_checkpoint(configured: str) -> Path:
    """The configured checkpoint, or the embedded default (tiny random weights, made once, cached)."""
    if configured:
        return Path(configured)
    target = default_checkpoint_dir()
    if (target / "speech_tokenizer" / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several model processes may start at once
        if not (target / "speech_tokenizer" / "model.safetensors").is_file():
            from ..models.random_checkpoint import make_checkpoint

            log.warning(
                "no checkpoint configured: making the default tiny RANDOM-WEIGHT checkpoint at %s. "
                "It produces noise, not speech; serve real weights with checkpoint_dir / --checkpoint.",
                target,
            )
            staging = Path(tempfile.mkdtemp(dir=target.parent))
            make_checkpoint("tiny", staging, seed=0)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(staging, target)
    return target


class SMPartition:
    """Run this process's GPU work on `sm_count` SMs (a CUDA green context), or the whole GPU (0).

    Kernels launched on `stream` are limited to the partition; on CPU it is a no-op. A whole-GPU
    partition can be `high_priority`: its blocks are scheduled ahead of normal-priority work (the
    urgent codec lane's, and the backbone's under `backbone_partition=shared`, so that background
    codec kernels only fill in around them).
    """

    def __init__(self, device: torch.device, sm_count: int, high_priority: bool = False):
        self.device, self.sm_count = device, sm_count
        self.stream = None
        self.context = None
        if device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if sm_count and sm_count < total:
            from torch.cuda.green_contexts import GreenContext

            self.context = GreenContext.create(sm_count, device.index or 0)
            self.stream = self.context.Stream()
            log.info("using a green context of %d of %d SMs", sm_count, total)
        else:
            self.stream = torch.cuda.Stream(device, priority=-1 if high_priority else 0)

    def new_stream(self) -> torch.cuda.Stream | None:
        """Another stream on this partition, at its priority (None on CPU)."""
        if self.stream is None:
            return None
        if self.context is not None:
            return self.context.Stream()
        return torch.cuda.Stream(self.device, priority=self.stream.priority)

    def __enter__(self):
        if self.stream is not None:
            self._outer = torch.cuda.stream(self.stream)
            self._outer.__enter__()
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            self._outer.__exit__(*exc)


def mps_active() -> bool:
    """True when this process talks to a CUDA MPS control daemon."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (pipe / "control").exists()
