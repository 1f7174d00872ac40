"""Codec call time per (batch, frames) shape, as the codec lanes run it: CUDA-graph replays (GPU).

    python benchmarks/codec_speed.py --checkpoint /tmp/ck-1.7b
    python benchmarks/codec_speed.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark   # cuDNN autotuned

Small shapes are what the urgent lane decodes (first chunks: 2 frames), large ones the background
lane's batches. To compare two versions of the code in one run, point PYTHONPATH at a checkout of
the other, e.g. `git archive <commit> voxtriton | tar -x -C /tmp/base` and `PYTHONPATH=/tmp/base`
(the output's "code" names the module path that ran). The script sets cuDNN autotuning itself
(`--cudnn-benchmark`, as the codec processes run by default). The checkpoint is random-weight
(`voxtriton make-checkpoint`): timings are real, the audio is noise.

    python benchmarks/codec_speed.py --checkpoint /tmp/ck-1.7b --cudnn-benchmark --shapes 1x1,8x2 --service

`--service` also times each shape's whole call as a codec model makes it, less Triton: the codec
service's `decode` with the codes on the host, the state rows gathered from and written back to a
pool on the device and the audio copied to the host (`service_ms`, the median wall time of
`--repeat` calls). Against the graph alone it is the host's share of a call; against the codec
model's time in a server (`serving_bench.py`'s `codec_models`) the rest is Triton's.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

import voxtriton
from voxtriton.bench.timing import call_shape, mean_ms, timed
from voxtriton.engine.codec_runner import CodecRunner
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_codec
from voxtriton.serving.codec_service import CodecService
from voxtriton.serving.settings import CodecSettings

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
    parser.add_argument("--service", action="store_true", help="also time the codec service's whole call")
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda, or cpu (eager fp32 calls: checks the script, times nothing useful)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    codec = load_codec(args.checkpoint, load_config(args.checkpoint), device=device, dtype=dtype)
    torch.manual_seed(0)
    result = {
        "code": voxtriton.__file__,
        "cudnn_benchmark": args.cudnn_benchmark,
        "gpu": torch.cuda.get_device_name(device) if gpu else None,
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
        call = functools.partial(runner.decode, codes, start, state)
        ms = mean_ms(call, args.repeat) if gpu else timed(call, device, args.repeat) * 1e3
        result["ms"][shape] = round(ms, 3)
        del runner  # its graphs' memory
        if args.service:
            result.setdefault("service_ms", {})[shape] = service_call_ms(args, batch, frames)
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def service_call_ms(args, batch: int, frames: int) -> float:
    """Median ms of `CodecService.decode` for one shape, its graph captured as the codec lanes do."""
    settings = CodecSettings(
        checkpoint_dir=str(args.checkpoint),
        device=args.device,
        cudnn_autotune=args.cudnn_benchmark,
        graph_batch_sizes=str(batch),
        graph_frame_sizes=str(frames),
    )
    service = CodecService(settings)
    config = service.model.config
    codes = torch.randint(0, config.codebook_size, (batch, frames, config.num_quantizers))
    start, slots = torch.ones(batch, dtype=torch.long), torch.arange(batch)  # streams past their start
    pool = torch.zeros(batch, service.state_size, device=service.device)
    seconds = timed(lambda: service.decode(codes, start, slots, pool), service.device, args.repeat)
    return round(seconds * 1e3, 3)


if __name__ == "__main__":
    main()
