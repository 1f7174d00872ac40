"""The codec lanes' work: decode a batch of chunks, state in, state out (no Triton types here)."""

from __future__ import annotations

import logging
import os

import torch

from ..engine.codec_runner import CodecRunner
from ..models.loader import load_codec
from .runtime import SMPartition, ensure_checkpoint, resolve_device, resolve_dtype
from .settings import CodecSettings, cache_dir, int_list

log = logging.getLogger(__name__)


class CodecService:
    def __init__(self, settings: CodecSettings, name: str = "codec"):
        self.settings, self.name = settings, name
        self.device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, self.device)
        self.model = load_codec(ensure_checkpoint(settings.checkpoint_dir), device=self.device, dtype=dtype)
        self.partition = SMPartition(self.device, settings.sm_count)
        graphs = self.device.type == "cuda" and settings.cuda_graphs
        with self.partition:
            self.runner = CodecRunner(self.model, int_list(settings.graph_batch_sizes) if graphs else None,
                                      int_list(settings.graph_frame_sizes) if graphs else None)
        self.state_size = self.model.state_size
        self.calls = 0

    def decode(self, codes: torch.Tensor, start: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """codes [B, T, Q] int, start [B] int64, state [B, S] -> (audio [B, T*spf] fp32, state [B, S] fp32)."""
        self._maybe_fail()
        if codes.dim() != 3 or codes.shape[2] != self.model.config.num_quantizers:
            raise ValueError(f"codes must be [batch, frames, {self.model.config.num_quantizers}], got {list(codes.shape)}")
        if state.shape != (codes.shape[0], self.state_size) or start.shape != (codes.shape[0],):
            raise ValueError(f"state must be [{codes.shape[0]}, {self.state_size}] and start [{codes.shape[0]}]")
        # An out-of-range code would be a device-side assert, which ends this process (and under MPS
        # can take its neighbours down): refuse it here with a clear error instead.
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.model.config.codebook_size:
            raise ValueError(f"codes must be in [0, {self.model.config.codebook_size}), got [{low}, {high}] "
                             f"(codes tensor on {codes.device})")
        if self.device.type == "cuda":  # inputs made on the caller's stream must be complete first
            self.partition.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self.partition:
            audio, new_state = self.runner.decode(codes.to(self.device), start.to(self.device), state.to(self.device))
            audio, new_state = audio.float(), new_state.float()
        if self.device.type == "cuda":
            self.partition.stream.synchronize()
        return audio, new_state

    def _maybe_fail(self) -> None:
        """Test-only fault injection (config parameter `test_fault`), to prove a failing lane fails
        only the requests it was serving. "raise:N": every Nth call raises. "exit:N": the Nth call
        kills this process, once per server (a marker file outlives the process, so the reloaded
        lane runs normally)."""
        self.calls += 1
        fault = self.settings.test_fault
        if not fault:
            return
        kind, _, every = fault.partition(":")
        if every and self.calls % int(every):
            return
        if kind == "raise":
            raise RuntimeError("injected codec fault (test_fault=raise)")
        if kind == "exit":
            marker = cache_dir() / "faults" / f"{self.name}-exit-{os.getppid()}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
                log.error("injected codec fault: exiting the process (test_fault=exit)")
                os._exit(17)
