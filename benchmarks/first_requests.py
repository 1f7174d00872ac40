"""The first requests after a server reports ready: is the first as fast as the tenth?

Starts a tritonserver with voxtriton, times how long it takes to report ready, then sends REQUESTS
requests one after another (same text, seed and length) and records each one's time to first audio
and stall time under simulated playback. With the server's warm-up on, the first request should
look like the rest; `--param tts:warmup=false` shows the cold server for comparison.

    python benchmarks/first_requests.py --checkpoint DIR --requests 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from voxtriton_client import TTSClient

from voxtriton.bench.fleet import hardware
from voxtriton.serving.launcher import TritonServer, parse_params


def git_commit() -> str:
    """COMMIT from the environment (a checkout copied without .git), else git's."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"].split()[0]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint directory (default: the tiny random one)"
    )
    parser.add_argument("--policy", default="voxserve")
    parser.add_argument("--tritonserver", default=None)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--text", default="The first requests after a server reports ready.")
    parser.add_argument("--max-frames", type=int, default=50)
    parser.add_argument(
        "--param", action="append", default=[], help="MODEL:KEY=VALUE, as for voxtriton serve"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    started = time.perf_counter()
    server = TritonServer(
        checkpoint=args.checkpoint,
        policy=args.policy,
        tritonserver=args.tritonserver,
        parameters=parse_params(args.param),
    )
    with server:
        ready_s = time.perf_counter() - started
        client = TTSClient(server.grpc_url)
        runs = []
        for index in range(args.requests):
            result = client.synthesize(
                args.text, seed=index, max_frames=args.max_frames, ignore_eos=True
            ).raise_for_error()
            playback = result.playback
            runs.append(
                {
                    "request": index,
                    "ttfa_ms": round(playback.ttfa_s * 1e3, 2),
                    "stall_ms": round(playback.stall_s * 1e3, 2),
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    later = [run["ttfa_ms"] for run in runs[1:]]
    report = {
        "command": " ".join(["python", *sys.argv]),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "device": hardware(),
        "policy": args.policy,
        "params": args.param,
        "ready_s": round(ready_s, 1),
        "requests": runs,
        "first_ttfa_ms": runs[0]["ttfa_ms"],
        "first_stall_ms": runs[0]["stall_ms"],
        "later_ttfa_ms_median": statistics.median(later) if later else None,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "requests"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
