"""Host time of the chunk scheduler per frame step: every running stream gets a frame, chunks are cut,
routed, batched and marked done, as the engine thread and the lane workers do (no model, no codec).

    python benchmarks/scheduler_overhead.py --streams 66 --steps 300
"""

from __future__ import annotations

import argparse
import platform
import time

from voxtriton.scheduler.policy import BACKGROUND, URGENT, ChunkScheduler, SchedulerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=66)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    scheduler = ChunkScheduler(SchedulerConfig())
    names = [f"s{i}" for i in range(args.streams)]
    for name in names:
        scheduler.open(name)
    started = time.perf_counter()
    for _ in range(args.steps):
        for name in names:
            scheduler.frames_generated(name, 1)
        for lane in (URGENT, BACKGROUND):
            while batch := scheduler.next_batch(lane):
                for chunk in batch:
                    scheduler.chunk_done(chunk, 0.01)
    per_step = (time.perf_counter() - started) / args.steps
    print(
        f"{args.streams} streams: {per_step * 1e3:.3f} ms of scheduler work per frame step "
        f"({platform.machine()}, {platform.python_version()})"
    )


if __name__ == "__main__":
    main()
