"""Time each convolution of one codec call (GPU): where a call's time goes, layer by layer.

    python benchmarks/codec_layers.py --checkpoint /tmp/ck-1.7b --json heuristic.json
    python benchmarks/codec_layers.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark --json autotuned.json

For each call shape (batch x frames) it decodes one chunk eagerly, records the arguments of every
`F.conv1d` / `F.conv2d` (the dilated layers) / `F.conv_transpose1d` the decoder makes, and times
each distinct layer. cuDNN picks each layer's algorithm by its heuristic, or with
`--cudnn-benchmark` by timing them. Compare the two in separate processes: PyTorch caches one plan
per convolution shape whichever way it was chosen, so within one process the first choice sticks.
With `--channels-last` each 1-D layer is also timed with its activation and weight stored
channels-last ([batch, time, channels] in memory, the same logical shape), the layout cuDNN's NHWC
kernels want: its output must match and its time shows what the NCW layout's transposes cost (the
channels-last total counts the other layers at their own time). The checkpoint is random-weight
(`voxtriton make-checkpoint`): timings are real, the audio is noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from voxtriton.bench.timing import call_shape, mean_ms
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_codec


def record_layers(codec, batch: int, frames: int) -> list[dict]:
    """Every convolution of one eager decode: one entry per distinct call shape, with its count."""
    layers: dict[tuple, dict] = {}
    # conv2d: the dilated layers, which the decoder runs as dense convolutions over a [time / d, d] view.
    originals = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv_transpose1d": F.conv_transpose1d}

    def recorder(name):
        def record(x, weight, bias=None, *positional, **options):
            key = (name, tuple(x.shape), tuple(weight.shape), positional, tuple(sorted(options.items())))
            if key in layers:
                layers[key]["count"] += 1
            else:
                layers[key] = {
                    "op": name,
                    "x": x.clone(),
                    "weight": weight,
                    "bias": bias,
                    "positional": positional,
                    "options": options,
                    "count": 1,
                }
            return originals[name](x, weight, bias, *positional, **options)

        return record

    for name in originals:
        setattr(F, name, recorder(name))
    try:
        codes = torch.randint(
            0, codec.config.codebook_size, (batch, frames, codec.config.num_quantizers), device="cuda"
        )
        codec.decode(codes, torch.zeros(batch, dtype=torch.long, device="cuda"), codec.new_state(batch))
    finally:
        for name, original in originals.items():
            setattr(F, name, original)
    return list(layers.values())


def channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """The same [N, C, L] tensor stored as [N, L, C]: what a conv1d's 4-D view reads as channels-last."""
    return tensor.transpose(1, 2).contiguous().transpose(1, 2)


def channels_last_timing(op, layer: dict) -> dict:
    """The layer run on channels-last activation and weight: its time, its output's layout, and
    its largest difference from the NCW result."""
    x, weight = channels_last(layer["x"]), channels_last(layer["weight"])
    run = lambda: op(x, weight, layer["bias"], *layer["positional"], **layer["options"])  # noqa: E731
    expected = op(layer["x"], layer["weight"], layer["bias"], *layer["positional"], **layer["options"])
    out = run()
    return {
        "channels_last_ms": round(mean_ms(run, 10), 4),
        "channels_last_output": out.stride(1) == 1,
        "channels_last_max_error": float((out.float() - expected.float()).abs().max()),
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--shapes", default="8x2,16x4,128x25", help="comma-separated BATCHxFRAMES")
    parser.add_argument(
        "--cudnn-benchmark", action="store_true", help="let cuDNN time its algorithms per shape"
    )
    parser.add_argument(
        "--channels-last", action="store_true", help="also time each layer stored channels-last"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    codec = load_codec(
        args.checkpoint, load_config(args.checkpoint), device=torch.device("cuda"), dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cudnn_benchmark": args.cudnn_benchmark,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": {},
    }
    for shape in args.shapes.split(","):
        batch, frames = call_shape(shape)
        rows, total, total_channels_last = [], 0.0, 0.0
        for layer in record_layers(codec, batch, frames):
            op = getattr(F, layer["op"])
            ms = mean_ms(
                lambda: op(
                    layer["x"], layer["weight"], layer["bias"], *layer["positional"], **layer["options"]
                ),
                10,
            )
            total += layer["count"] * ms
            row = {
                "op": layer["op"],
                "x": list(layer["x"].shape),
                "weight": list(layer["weight"].shape),
                "arguments": [
                    *map(str, layer["positional"]),
                    *(f"{k}={v}" for k, v in layer["options"].items()),
                ],
                "count": layer["count"],
                "ms": round(ms, 4),
            }
            if args.channels_last and layer["x"].dim() == 3:
                row.update(channels_last_timing(op, layer))
            total_channels_last += layer["count"] * row.get("channels_last_ms", ms)
            rows.append(row)
            print(json.dumps({"shape": shape, **row}), flush=True)
        totals = {"total_ms": round(total, 3)}
        if args.channels_last:
            totals["channels_last_total_ms"] = round(total_channels_last, 3)
        result["shapes"][shape] = {"layers": rows, **totals}
        print(json.dumps({"shape": shape, **totals}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
