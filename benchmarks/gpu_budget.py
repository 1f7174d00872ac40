"""The GPU time a serving probe asks for, from the backbone's and the codec's measured speeds alone.

A probe at R req/s with A seconds of audio per request asks the GPU for R x A seconds of audio per
second. Alone on the GPU, the backbone's frame step at the probe's mean batch (`model_speed.py`) and
the codec's best call shape (`codec_speed.py`) each cost some GPU milliseconds per second of audio;
their sum times the demand is the GPU seconds per second the probe needs if the two ran one after
the other at those speeds. Near 1, no lane policy can add much: the lanes can only overlap the two
(kernels of both running on the GPU at once), not make either cheaper. The bound
`R / (GPU seconds per second)` is the rate that would fill the GPU at those speeds.

A second table bounds every policy at once: at each measured batch (the KV-cache rows in use), the
request rate the backbone alone sustains with nothing else on the GPU (frames per second over frames
per request), and the rate at which the backbone and the codec, run one after the other, fill it.
A policy's goodput above the first needs a faster backbone, not better lanes; the second is what a
perfect overlap of the two would have to beat. With --baseline-goodput each is also a ratio to it.

    python benchmarks/gpu_budget.py --model-speed MODEL_SPEED.json --codec-speed CODEC_SPEED.json \
        RUN_DIR [...] [--baseline-goodput REQ_PER_S]

RUN_DIR: serving_bench outputs (results.json); only probes of the model_speed preset are used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from voxtriton.bench.goodput import probes
from voxtriton.bench.gpu_budget import budget, ceilings, codec_ms_per_audio_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--model-speed", type=Path, required=True, help="model_speed.py --json output")
    parser.add_argument("--codec-speed", type=Path, required=True, help="codec_speed.py --json output")
    parser.add_argument(
        "--baseline-goodput", type=float, help="req/s: print each ceiling as a ratio to it too"
    )
    args = parser.parse_args()
    model_speed = json.loads(args.model_speed.read_text())
    codec = codec_ms_per_audio_s(json.loads(args.codec_speed.read_text()))
    best_shape = min(codec, key=codec.get)
    preset = model_speed["meta"]["preset"]
    print(
        "codec GPU ms per audio second by call shape: "
        + ", ".join(f"{shape} {ms:.3f}" for shape, ms in codec.items())
        + f"; the budget uses the best, {best_shape}"
    )
    print(
        "| model | policy | run | rate/s | passed | audio s per request | audio s per s | mean batch "
        "| backbone ms per audio s | codec ms per audio s | GPU s per s | rate filling the GPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    usable = [
        p
        for run in args.runs
        for p in probes(run)
        if p["model"] == preset and p["completed"] and p["audio_s"] and p["frame_step_batch"]
    ]
    if not usable:
        sys.exit(
            f"no probe of preset {preset} with completed requests, audio_s and a mean batch in {args.runs}"
        )
    for probe in sorted(usable, key=lambda p: (p["policy"], p["rate"], p["run"])):
        b = budget(probe, model_speed, codec[best_shape])
        print(
            f"| {probe['model']} | {probe['policy']} | {probe['run']} | {probe['rate']:.0f} | "
            f"{'yes' if probe['passed'] else 'no'} | {b['audio_s_per_request']:.2f} | "
            f"{b['demand_audio_s_per_s']:.0f} | {probe['frame_step_batch']:.0f} | "
            f"{b['backbone_ms_per_audio_s']:.3f} | {b['codec_ms_per_audio_s']:.3f} | "
            f"{b['gpu_s_per_s']:.2f} | {b['rate_filling_gpu']:.0f} |"
        )
    audio_per_request = sum(p["audio_s"] for p in usable) / sum(p["completed"] for p in usable)
    meta = model_speed["meta"]
    context = f", model speed at a context of {meta['context']}" if "context" in meta else ""
    print(
        f"\nCeilings for any policy at {audio_per_request:.2f} s of audio per request (the probes' mean)"
        f"{context}{' (rows spread over it)' if meta.get('spread') else ''}:"
    )
    against = f" (x {args.baseline_goodput:g} req/s)" if args.baseline_goodput else ""
    print(f"| rows | frame step ms | backbone alone, req/s{against} | backbone then codec, req/s{against} |")
    print("|---|---|---|---|")
    for c in ceilings(model_speed, codec[best_shape], audio_per_request):
        cells = [
            f"{c[key]:.0f}" + (f" ({c[key] / args.baseline_goodput:.2f}x)" if args.baseline_goodput else "")
            for key in ("backbone_alone", "backbone_then_codec")
        ]
        print(f"| {c['batch']} | {c['frame_step_ms']:.2f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
