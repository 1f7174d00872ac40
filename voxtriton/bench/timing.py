"""Timing helpers of the GPU micro-benchmarks, and the codec call shapes they name."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs, after two warm-up runs."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def graphed(fn, device: torch.device):
    """fn captured as a CUDA graph (replayed by the returned callable); fn itself on CPU."""
    if device.type != "cuda":
        return fn
    for _ in range(2):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def call_shape(shape: str) -> tuple[int, int]:
    """(chunks, frames per chunk) of a codec call shape written BATCHxFRAMES, as SHAPES and this
    script's JSON name them."""
    batch, frames = (int(part) for part in shape.split("x"))
    return batch, frames


def mean_ms(call, repeat: int) -> float:
    """Mean milliseconds of call() over `repeat` calls (CUDA events), after three warm-up calls (with
    cuDNN autotuning, the first times the algorithms)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeat):
        call()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeat
