"""The codec lanes' work: decode a batch of chunks, state in, state out (no Triton types here)."""

from __future__ import annotations

import logging
import os

import torch

from ..engine.codec_runner import CodecRunner
from ..models.families import load_family
from .runtime import SMPartition, ensure_checkpoint, resolve_device, resolve_dtype
from .settings import CodecSettings, cache_dir, int_list, lane_sms

log = logging.getLogger(__name__)


class CodecService:
    def __init__(self, settings: CodecSettings, name: str = "codec"):
        self.settings, self.name = settings, name
        self.device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, self.device)
        self.family = load_family(ensure_checkpoint(settings.checkpoint_dir))
        self.model = self.family.load_codec(device=self.device, dtype=dtype)
        sm_count = 0
        if self.device.type == "cuda":
            sm_count = lane_sms(
                settings.sm_count, torch.cuda.get_device_properties(self.device).multi_processor_count
            )
        self.partition = SMPartition(self.device, sm_count, settings.high_priority)
        graphs = self.device.type == "cuda" and settings.cuda_graphs
        # Process-wide (this process runs only the codec): shapes are autotuned before their graph
        # capture; without graphs every shape would pay for it while serving, so none are.
        torch.backends.cudnn.benchmark = settings.cudnn_autotune and graphs
        with self.partition:
            batch_sizes, frame_sizes = settings.graph_shapes() if graphs else (None, None)
            # Either lane primes (a stream pinned to the background lane primes there), for a family
            # whose codec states are primed (Qwen3-TTS Base; a CSM voice is a context turn instead).
            primes = graphs and hasattr(self.model, "prime")
            priming_sizes = int_list(settings.graph_priming_sizes) if primes else []
            self.runner = CodecRunner(self.model, batch_sizes, frame_sizes, priming_sizes)
        self.state_size = self.model.state_size
        self.calls = 0

    def decode(
        self,
        codes: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        pool: torch.Tensor,
        warmup: bool = False,
        prime: bool = False,
    ) -> torch.Tensor:
        """codes [B, T, Q] int, start [B] int64, slots [B] int64 -> audio [B, T*spf] fp32.

        Each stream's codec state is row `slots[i]` of `pool` (see state_pool): read, advanced and
        written back in place; a stream at frame 0 starts from a fresh state, whatever its row holds.
        `warmup`: a call of the tts model's warm-up, which test faults leave alone. `prime`: only
        the state is advanced (an in-context voice's reference codes): audio [B, 0].
        """
        if not warmup:
            self._maybe_fail()
        batch = codes.shape[0]
        if codes.dim() != 3 or codes.shape[2] != self.model.config.num_quantizers:
            raise ValueError(
                f"codes must be [batch, frames, {self.model.config.num_quantizers}], got {list(codes.shape)}"
            )
        if start.shape != (batch,) or slots.shape != (batch,):
            raise ValueError(
                f"start and slots must be [{batch}], got {list(start.shape)} and {list(slots.shape)}"
            )
        if pool.dim() != 2 or pool.shape[1] != self.state_size:
            raise ValueError(
                f"state_pool holds states of {pool.shape[1:]} values, this codec needs {self.state_size}"
            )
        # An out-of-range code or slot would be a device-side assert, which ends this process (and
        # under MPS can take its neighbours down): refuse it here with a clear error instead.
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.model.config.codebook_size:
            raise ValueError(f"codes must be in [0, {self.model.config.codebook_size}), got [{low}, {high}]")
        if len(set(slots.tolist())) != batch or int(slots.min()) < 0 or int(slots.max()) >= pool.shape[0]:
            raise ValueError(
                f"slots must be distinct rows of the state pool [0, {pool.shape[0]}), got {slots.tolist()}"
            )
        slots = slots.to(pool.device)
        with self.partition:
            start = start.to(self.device)
            state = pool[slots].to(self.device).masked_fill_((start == 0)[:, None], 0.0)
            if prime:
                new_state = self.runner.prime(codes.to(self.device), start, state)
                audio = torch.zeros(batch, 0, device=self.device)
            else:
                audio, new_state = self.runner.decode(codes.to(self.device), start, state)
            pool[slots] = new_state.float().to(pool.device)
            audio = audio.float().cpu()  # waits for the decode and (same device) the state write-back
            if prime and self.device.type == "cuda":  # no audio to wait for: wait for the write-back
                torch.cuda.current_stream(self.device).synchronize()
        if pool.device != self.device and pool.device.type == "cuda":  # disaggregated: the pool is elsewhere
            torch.cuda.current_stream(pool.device).synchronize()
        return audio

    def _maybe_fail(self) -> None:
        """Test-only fault injection (config parameter `test_fault`), to prove a failing lane fails
        only the requests it was serving. "raise:N": every Nth call raises. "exit:N": the Nth call
        kills this process, once per server (a marker file outlives the process, so the reloaded
        lane runs normally). The warm-up's calls are not counted."""
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


class InProcessLane:
    """A codec lane in the caller's process (benchmarks, tools): the `CodecLane` protocol without BLS."""

    def __init__(self, service: CodecService, pool: torch.Tensor):
        self.service, self.pool = service, pool

    def decode(
        self, codes: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, prime: bool = False
    ) -> torch.Tensor:
        return self.service.decode(codes, start, slots, self.pool, prime=prime)
