"""Codec call time per (batch, frames) shape, as the codec lanes run it: CUDA-graph replays (GPU).

    python benchmarks/codec_speed.py --checkpoint /tmp/ck-1.7b
    python benchmarks/codec_speed.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark   # cuDNN autotuned

Small shapes are what the urgent lane decodes (first chunks: 2 frames), large ones the background
lane's batches. To compare two versions of the code in one run, point PYTHONPATH at a checkout of
the other, e.g. `git archive <commit> voxtriton | tar -x -C /tmp/base` and `PYTHONPATH=/tmp/base`
(the output's "code" names the module path that ran). The script sets cuDNN autotuning itself
(`--cudnn-benchmark`, as the codec processes run by default). The checkpoint is random-weight
(`voxtriton make-checkpoint`): timings are real, the audio is noise.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

import voxtriton
from voxtriton.bench.timing import call_shape, mean_ms
from voxtriton.engine.codec_runner import CodecRunner
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_codec

SHAPES = "8x2,32x2,16x4,64x8,32x16,128x25,256x25"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated BATCHxFRAMES")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument(
        "--cudnn-benchmark", action="store_true", help="let cuDNN time its algorithms per shape"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device("cuda")
    codec = load_codec(args.checkpoint, load_config(args.checkpoint), device=device, dtype=torch.bfloat16)
    torch.manual_seed(0)
    result = {
        "code": voxtriton.__file__,
        "cudnn_benchmark": args.cudnn_benchmark,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "ms": {},
    }
    for shape in args.shapes.split(","):
        batch, frames = call_shape(shape)
        runner = CodecRunner(codec, [batch], [frames])
        codes = torch.randint(
            0, codec.config.codebook_size, (batch, frames, codec.config.num_quantizers), device=device
        )
        start = torch.zeros(batch, dtype=torch.long, device=device)
        state = codec.new_state(batch)
        result["ms"][shape] = round(
            mean_ms(functools.partial(runner.decode, codes, start, state), args.repeat), 3
        )
        del runner  # its graphs' memory
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
