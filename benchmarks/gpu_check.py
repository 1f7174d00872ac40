"""How fast this GPU host is, in a few seconds, before a long measurement on it.

    python benchmarks/gpu_check.py [--json OUT] [--min-tflops 450] [--min-gbps 2500] \
        [--max-graph-kernel-us 8] [--max-python-ms 400]

A goodput run is only as good as the host it ran on and the kernels it ran: a variable named CC
in the environment that is not a C compiler (Triton builds its kernel launchers with $CC) turns
every Triton kernel off (their slower PyTorch formulas run instead), and the engine thread's host
time per step differs between hosts of one GPU type (goodput_h200.md). This prints whether each
of voxtriton's Triton kernels passes its check on this GPU (`voxtriton.kernels.check_kernels`, as
the server runs it), a bf16 matrix product's TFLOP/s, a
device-to-device copy's GB/s (read plus write), the GPU time of one tiny kernel replayed in a
CUDA graph (the code predictor's steps are made of such kernels), a fixed pure-Python loop's time
(the engine thread is Python), the host's processor, the CPUs this process may use and its
cgroup's CPU quota, and what nvidia-smi says of clocks, power and the processes on the GPU (this
one's pid is in the output). It exits 1, naming each figure outside its bound, when a kernel
fails its check or the host is slower than a bound, so a script can stop before spending its time
on goodput runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def gpu_seconds(fn, repeat: int) -> float:
    """Median GPU seconds of fn(), by CUDA events, after a warm-up run."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return sorted(samples)[len(samples) // 2]


def matmul_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / gpu_seconds(lambda: torch.mm(a, b), repeat=10) / 1e12


def copy_gbps(megabytes: int = 2048) -> float:
    source = torch.empty(megabytes * 2**20, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    return 2 * source.numel() / gpu_seconds(lambda: target.copy_(source), repeat=10) / 1e9


def graph_kernel_us(kernels: int = 2000) -> float:
    """GPU microseconds per tiny kernel, kernels replayed back to back from one CUDA graph."""
    value = torch.zeros(256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        value.add_(1)  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(kernels):
            value.add_(1)
    return gpu_seconds(graph.replay, repeat=5) / kernels * 1e6


def python_loop_ms(iterations: int = 2_000_000) -> float:
    start = time.perf_counter()
    total = 0
    for index in range(iterations):
        total += index % 7
    return (time.perf_counter() - start) * 1e3


def host() -> dict:
    """The processor model, the CPUs this process may run on, the cgroup's CPU quota ("max" for
    none) and the load average, to tell hosts of one GPU type apart: the engine thread's time per
    step differs between them."""

    def first_line(path: str, prefix: str = "") -> str | None:
        try:
            with open(path) as handle:
                for line in handle:
                    if line.startswith(prefix):
                        return line.split(":", 1)[-1].strip() if prefix else line.strip()
        except OSError:
            return None
        return None

    return {
        "cpu_model": first_line("/proc/cpuinfo", "model name"),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cgroup_cpu_max": first_line("/sys/fs/cgroup/cpu.max"),
        "load_average": os.getloadavg(),
    }


def nvidia_smi() -> str:
    query = [
        "nvidia-smi",
        "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,"
        "temperature.gpu,utilization.gpu,compute_mode,mig.mode.current",
        "--format=csv",
    ]
    apps = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"]
    try:
        return "\n".join(
            subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
            for command in (query, apps)
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi failed: {error}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--min-tflops", type=float, default=450.0)
    parser.add_argument("--min-gbps", type=float, default=2500.0)
    parser.add_argument("--max-graph-kernel-us", type=float, default=8.0)
    parser.add_argument("--max-python-ms", type=float, default=400.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    from voxtriton.kernels import check_kernels  # the checkout's package (setup_env.sh puts it on the path)

    kernels = check_kernels(torch.device("cuda", 0))
    figures = {
        "device": torch.cuda.get_device_name(0),
        "pid": os.getpid(),
        "kernels_failing_their_check": sorted(name for name, usable in kernels.items() if not usable),
        "matmul_tflops": round(matmul_tflops(), 1),
        "copy_gbps": round(copy_gbps(), 1),
        "graph_kernel_us": round(graph_kernel_us(), 2),
        "python_loop_ms": round(python_loop_ms(), 1),
        "host": host(),
        "nvidia_smi": nvidia_smi(),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)
    slow = [
        text
        for text, bad in (
            (
                f"matmul_tflops {figures['matmul_tflops']} < {args.min_tflops}",
                figures["matmul_tflops"] < args.min_tflops,
            ),
            (f"copy_gbps {figures['copy_gbps']} < {args.min_gbps}", figures["copy_gbps"] < args.min_gbps),
            (
                f"graph_kernel_us {figures['graph_kernel_us']} > {args.max_graph_kernel_us}",
                figures["graph_kernel_us"] > args.max_graph_kernel_us,
            ),
            (
                f"python_loop_ms {figures['python_loop_ms']} > {args.max_python_ms}",
                figures["python_loop_ms"] > args.max_python_ms,
            ),
            (
                f"Triton kernels failing their check: {', '.join(figures['kernels_failing_their_check'])}",
                bool(figures["kernels_failing_their_check"]),
            ),
        )
        if bad
    ]
    if slow:
        print(f"gpu_check: {'; '.join(slow)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
