"""Routing policies over 8, 64 and 512 GPUs, simulated on the CPU from one H200's capacity curve.

For each policy and GPU count: the goodput per GPU (bisection; p90 TTFA <= 200 ms and no stall) as
a ratio to one GPU's measured goodput, and the p99 TTFA at fixed shares of it
(`voxtriton/bench/routing_sim.py` states the model).

    python benchmarks/routing_sim.py [--gpus 8,64,512] [--loads 0.9,0.97] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voxtriton.bench.routing_sim import POLICIES, goodput, read_capacity, simulate

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--goodput-json", type=Path, default=RESULTS / "goodput_h200.json")
    parser.add_argument("--single-stream-json", type=Path, default=RESULTS / "single_stream_triton_h200.json")
    parser.add_argument("--server-policy", default="voxserve", help="the capacity curve of this policy")
    parser.add_argument("--gpus", default="8,64,512")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--loads", default="0.9,0.97", help="p99 TTFA at these shares of the goodput")
    parser.add_argument("--steps", type=int, default=8, help="bisection steps over 0.7-1.1x the goodput")
    parser.add_argument("--warm-up", type=float, default=6.0, help="seconds of arrivals not measured")
    parser.add_argument(
        "--gpu-seconds",
        type=float,
        default=480.0,
        help="seconds measured x GPUs (the same exposure to a stall at every N), at least 2 s",
    )
    parser.add_argument("--proxies", type=int, default=4, help="k of k_proxies")
    parser.add_argument("--scrape", type=float, default=5.0, help="seconds between stale_metrics scrapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    args = parser.parse_args()

    capacity = read_capacity(args.goodput_json, args.single_stream_json, args.server_policy)
    loads = [float(x) for x in args.loads.split(",")]
    rows = []
    for gpus in [int(n) for n in args.gpus.split(",")]:
        options = dict(
            seed=args.seed,
            warm_up_s=args.warm_up,
            measure_s=max(2.0, args.gpu_seconds / gpus),
            proxies=args.proxies,
            scrape_s=args.scrape,
        )
        for policy in args.policies.split(","):
            rate = goodput(capacity, policy, gpus, args.steps, **options)
            row = {
                "gpus": gpus,
                "policy": policy,
                "goodput_per_gpu": round(rate, 2),
                "goodput_ratio": round(rate / capacity.goodput, 3),
                "at_load": [],
            }
            for load in loads:
                run = simulate(capacity, policy, gpus, load * capacity.goodput, **options)
                row["at_load"].append(
                    {
                        "load": load,
                        "ttfa_p99_ms": round(run.ttfa_p99_ms, 1),
                        "excess_p99": round(run.excess_p99, 1),
                        "stalled": run.stalled,
                        "requests": run.requests,
                    }
                )
            rows.append(row)
            print(rows[-1], flush=True)
    print(f"\none GPU measured: {capacity.goodput:g} req/s")
    at = " | ".join(f"p99 TTFA, excess p99, stalled at {x:g}x" for x in loads)
    print(f"\n| policy | GPUs | goodput/GPU (req/s) | vs one GPU | {at} |")
    print("|---|---|---|---|" + "---|" * len(loads))
    for r in sorted(rows, key=lambda r: (POLICIES.index(r["policy"]), r["gpus"])):
        cells = " | ".join(
            f"{a['ttfa_p99_ms']:.1f} ms, {a['excess_p99']:.1f}, {a['stalled']}" for a in r["at_load"]
        )
        rate = f"{r['goodput_per_gpu']:.1f} | {r['goodput_ratio']:.3f}"
        print(f"| {r['policy']} | {r['gpus']} | {rate} | {cells} |")
    if args.json:
        meta = {
            "capacity": {
                "server_policy": args.server_policy,
                "streams": capacity.streams.round(1).tolist(),
                "ttfa_ms": capacity.ttfa_ms.round(2).tolist(),
                "stall_streams": capacity.stall_streams,
                "goodput": capacity.goodput,
            },
            "args": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
