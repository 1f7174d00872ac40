"""Checks benchmarks/serving_bench.py makes of a server before measuring it (no server)."""

from __future__ import annotations

import logging

import torch

from voxtriton.bench.fleet import kernel_fallbacks

# Lines of a real server log whose environment had a CC that named no compiler.
FALLBACK = (
    "2026-12-03 14:05:08,646 voxtriton WARNING voxtriton.kernels: Triton kernel decode_attention unavailable "
    "on cuda:0 (FileNotFoundError: [Errno 2] No such file or directory: '--param "
    "tts:scheduler_chunk_schedule=2,2,4,8,16,25'); using its slower PyTorch formula"
)
GREEN_CONTEXT = (
    "2026-12-03 14:05:08,695 voxtriton INFO voxtriton.serving.runtime: using a green context of 96 of 132 SMs"
)
GRAPHS = (
    "2026-12-03 14:05:22,090 voxtriton INFO voxtriton: tts: captured 28 frame-step, 16 prefill, 32 admission "
    "and 2 row-move CUDA graphs"
)


def test_a_gpu_kernel_that_failed_its_check_is_found_in_the_server_log():
    log = "\n".join([GREEN_CONTEXT, FALLBACK, FALLBACK.replace("decode_attention", "rotary"), GRAPHS])
    assert kernel_fallbacks(log) == [FALLBACK, FALLBACK.replace("decode_attention", "rotary")]


def test_a_log_without_fallbacks_gives_none():
    assert kernel_fallbacks("\n".join([GREEN_CONTEXT, GRAPHS])) == []


def test_a_gpu_without_the_triton_package_logs_every_kernel_as_a_fallback(monkeypatch, caplog):
    """Without triton the kernels fall back too: each says so in the log, which the benchmark reads.
    (check_kernels touches no GPU before it finds triton missing, so this runs on CPU.)"""
    import voxtriton.kernels.registry as kernels

    monkeypatch.setattr(kernels, "triton", None)
    with caplog.at_level(logging.WARNING, logger=kernels.log.name):
        usable = kernels.check_kernels(torch.device("cuda", 0))
    assert usable and not any(usable.values())
    found = kernel_fallbacks("\n".join(record.getMessage() for record in caplog.records))
    assert len(found) == len(usable) and all("cannot be imported" in line for line in found)
