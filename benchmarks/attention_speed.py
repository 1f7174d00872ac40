"""Decode attention's launch shapes, timed alone: the frame step's two attention calls on the GPU.

A frame step makes 28 talker attention calls over each row's cache (up to the span, 512 in
model_speed) and 75 code-predictor calls over at most 16 entries. For each case this times
`decode_attention` at the shipped launch shape (`launch_shape`) and at every shape in the sweep
(keys per block x warps x pipeline stages), and reports the bandwidth of the keys and values each
call must read.

    python benchmarks/attention_speed.py --json attention.json          # GPU; 1.7B / 0.6B head shapes

Random inputs (the kernel's speed does not depend on the values). The shipped shape's output is
checked against the SDPA reference and every other shape's against the shipped one's before it is
timed. On a GPU the calls are timed as CUDA graph replays, as the server runs them: eager launches
cost more host time than the smallest calls take. Each case's caches are at most 0.3 GB and are read
call after call, so part of them may come from the L2 cache (50 MB), not HBM: GB/s above the HBM's
4.8 TB/s say so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from voxtriton.bench.timing import graphed, timed
from voxtriton.kernels.attention import decode_attention, decode_attention_reference, launch_shape

CALLS_PER_SAMPLE = 20  # one call can take a few microseconds: too short to time alone
HEADS, KV_HEADS, DIM = 16, 8, 128  # both Qwen3-TTS presets, talker and code predictor alike
# name -> (rows, span, where the rows' last positions are): "full" every row at span - 1 (model_speed's
# case), "spread" evenly over 0..span - 1 (a serving batch's mix of young and old streams).
CASES = {
    "talker_256_full": (256, 512, "full"),
    "talker_256_spread": (256, 512, "spread"),
    "talker_16_full": (16, 512, "full"),
    "predictor_256": (256, 16, "full"),
    "predictor_16": (16, 16, "full"),
}


def case_inputs(rows: int, span: int, where: str, device: torch.device, dtype: torch.dtype):
    """q [rows, H, 1, D], keys and values as views of a larger cache (as StaticKV hands them out),
    positions."""
    generator = torch.Generator(device).manual_seed(0)
    q = torch.randn(rows, HEADS, 1, DIM, device=device, generator=generator).to(dtype)
    cache = torch.randn(2, rows, KV_HEADS, span + 64, DIM, device=device, generator=generator).to(dtype)
    last = (
        torch.full((rows,), span - 1) if where == "full" else torch.linspace(0, span - 1, rows).round().long()
    )
    return q, cache[0, :, :, :span], cache[1, :, :, :span], last[:, None].to(device)


def kv_bytes(positions: torch.Tensor, dtype: torch.dtype) -> int:
    """Key and value bytes the call must read: each row's entries up to its position, every KV head."""
    return int((positions[:, -1] + 1).sum()) * KV_HEADS * DIM * 2 * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    parser.add_argument("--rows", type=int, help="rows of every case (default: each case's own)")
    parser.add_argument("--block-keys", default="16,32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--repeat", type=int, default=200, help="calls timed per shape, in samples of 20")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run in Triton's interpreter (TRITON_INTERPRET=1), fp32"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1")
    dtype = (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )  # the interpreter's bf16 tl.dot is wrong
    sweep = list(
        itertools.product(
            *(map(int, option.split(",")) for option in (args.block_keys, args.warps, args.stages))
        )
    )
    results = []
    for name in args.cases.split(","):
        rows, span, where = CASES[name]
        rows = args.rows or rows
        q, keys, values, positions = case_inputs(rows, span, where, device, dtype)
        shipped = launch_shape(span, keys.dtype)
        shipped_out = decode_attention(q, keys, values, positions, 0.1)
        torch.testing.assert_close(
            shipped_out.float(),
            decode_attention_reference(q, keys, values, positions, 0.1),
            rtol=2e-2,
            atol=2e-2,
        )
        timings = {}
        for launch in [shipped] + [s for s in sweep if s != shipped]:
            try:
                out = decode_attention(q, keys, values, positions, 0.1, launch=launch)
            except Exception as error:  # a shape this GPU cannot launch (shared memory): reported, not fatal
                timings[launch] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
                continue
            torch.testing.assert_close(out, shipped_out, rtol=2e-2, atol=2e-2)
            calls = graphed(
                lambda: [
                    decode_attention(q, keys, values, positions, 0.1, launch=launch)
                    for _ in range(CALLS_PER_SAMPLE)
                ],
                device,
            )
            timings[launch] = timed(calls, device, max(1, args.repeat // CALLS_PER_SAMPLE)) / CALLS_PER_SAMPLE
        best = min((t, launch) for launch, t in timings.items() if isinstance(t, float))
        row = {
            "case": name,
            "rows": rows,
            "span": span,
            "positions": where,
            "kv_mb": kv_bytes(positions, dtype) / 1e6,
            "shipped": list(shipped),
            "shipped_us": timings[shipped] * 1e6,
            "best": list(best[1]),
            "best_us": best[0] * 1e6,
            "all": {
                "x".join(map(str, launch)): (t * 1e6 if isinstance(t, float) else t)
                for launch, t in timings.items()
            },
        }
        row["shipped_gb_s"] = row["kv_mb"] / 1e3 / (row["shipped_us"] / 1e6)
        row["best_gb_s"] = row["kv_mb"] / 1e3 / (row["best_us"] / 1e6)
        results.append(row)
        print(
            f"{name}: shipped {shipped} {row['shipped_us']:.1f} us ({row['shipped_gb_s']:.0f} GB/s), "
            f"best {best[1]} {row['best_us']:.1f} us ({row['best_gb_s']:.0f} GB/s)",
            flush=True,
        )
    print(
        "\n| case | KV MB | shipped (keys, warps, stages) | us | GB/s | best | us | GB/s |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['case']} | {r['kv_mb']:.1f} | {tuple(r['shipped'])} | {r['shipped_us']:.1f} | "
            f"{r['shipped_gb_s']:.0f} "
            f"| {tuple(r['best'])} | {r['best_us']:.1f} | {r['best_gb_s']:.0f} |"
        )
    meta = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "dim": DIM,
        "dtype": str(dtype),
    }
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
