"""Floating-point operations per frame of audio, and the rate the GPU runs them at.

Counts the operations of the backbone's frame step (talker, 15 code-predictor steps, sampling: what
`ModelRunner.decode` runs) and of a codec call, with PyTorch's FlopCounterMode on the meta device:
the real modules at a checkpoint's shapes, no weights, no GPU. Given the times `model_speed.py` and
`codec_speed.py` measured (their --json output), it divides one by the other: the TFLOP/s each
shape reached.

    python benchmarks/frame_flops.py --checkpoint CKPT [--model-speed MS.json] [--codec-speed CS.json]

CKPT needs only config.json and speech_tokenizer/config.json (the reference configs will do).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voxtriton.bench.flops import backbone_flops_per_frame, codec_flops_per_frame
from voxtriton.bench.timing import call_shape
from voxtriton.models.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument(
        "--model-speed", type=Path, help="model_speed.py --json output (frame step ms per batch)"
    )
    parser.add_argument("--codec-speed", type=Path, help="codec_speed.py --json output (ms per call shape)")
    parser.add_argument("--span", type=int, default=512, help="attention span without --model-speed")
    args = parser.parse_args()
    config = load_config(args.checkpoint)
    print("| part | shape | GFLOP per frame | measured ms | TFLOP/s |")
    print("|---|---|---|---|---|")
    if args.model_speed:
        speed = json.loads(args.model_speed.read_text())
        span = speed["meta"]["context"]
        for row in speed["rows"]:
            flops = backbone_flops_per_frame(config, row["batch"], span)
            rate = flops * row["batch"] / (row["frame_step_ms"] / 1e3) / 1e12
            print(
                f"| frame step | batch {row['batch']}, span {span} | {flops / 1e9:.2f} | "
                f"{row['frame_step_ms']:.2f} | {rate:.0f} |"
            )
    else:
        flops = backbone_flops_per_frame(config, 1, args.span)
        print(f"| frame step | span {args.span} | {flops / 1e9:.2f} | - | - |")
    shapes = json.loads(args.codec_speed.read_text())["ms"] if args.codec_speed else {"1x25": None}
    for shape, ms in shapes.items():
        batch, frames = call_shape(shape)
        flops = codec_flops_per_frame(config, batch, frames)
        rate = "-" if ms is None else f"{flops * batch * frames / (ms / 1e3) / 1e12:.0f}"
        print(f"| codec call | {shape} | {flops / 1e9:.2f} | {'-' if ms is None else ms} | {rate} |")


if __name__ == "__main__":
    main()
