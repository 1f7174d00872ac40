"""Model speed by batch size: talker step, 15-step code predictor, whole frame step, codec.

    python benchmarks/model_speed.py --preset tiny                       # CPU, tiny random checkpoint
    python benchmarks/model_speed.py --preset 1.7b --device cuda --graphs  # GPU
    python benchmarks/model_speed.py --preset 1.7b --device cuda --batch-sizes 16 --profile 15
        # plus the top 15 kernels of one eager frame step and one eager codec call (where to optimize)

Checkpoints are random-weight (made with `voxtriton make-checkpoint` into a temporary directory
unless --checkpoint is given): timings are real, the audio is noise. Prints a markdown table and,
with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from voxtriton.bench.timing import graphed, timed
from voxtriton.engine.codec_runner import CodecRunner
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.kernels import turn_off
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import quantize_backbone
from voxtriton.models.loader import load_backbone, load_codec
from voxtriton.models.random_checkpoint import make_checkpoint
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.settings import FP8_SCOPES


def top_kernels(fn, device: torch.device, count: int) -> str:
    """torch.profiler's table of the `count` costliest operations of two eager runs of fn (after one
    warm-up). Eager, because a CUDA graph replay shows as one launch; the graph runs the same kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        fn()
        with profile(activities=activities) as profiler:
            for _ in range(2):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=count)


def row_positions(batch: int, context: int, spread: bool, device) -> torch.Tensor:
    """Each row's current position: all at context - 1, or (spread) evenly from context - 1 down to 64,
    the mix of young and old streams a server holds (the first row always at context - 1)."""
    if not spread:
        return torch.full((batch,), context - 1, device=device)
    return torch.linspace(context - 1, min(64, context - 1), batch, device=device).long()


def fill_rows(
    runner: ModelRunner, config, prompts: PromptBuilder, batch: int, context: int, spread: bool
) -> int:
    """Prefill `batch` requests and advance them to `context` positions (see `row_positions`);
    returns the span."""
    params = GenerationParams.create(config.generation, 100_000, seed=0, max_frames=50_000, ignore_eos=True)
    requests = [
        Request(f"r{i}", prompts.build("Benchmarking the talker step.", prompts.speakers[0]), params)
        for i in range(batch)
    ]
    runner.prefill(requests, 0)
    length = len(requests[0].prompt.text_ids)
    runner.state.position[:batch] = row_positions(batch, context, spread, runner.device)
    return max(context, length)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", choices=("tiny", "0.6b", "1.7b"))
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 (default: bf16 on GPU, fp32 on CPU)"
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=256, help="KV positions each request attends over")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="rows at positions spread evenly up to --context instead of all at it",
    )
    parser.add_argument("--chunk-frames", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs for every timed step (GPU)")
    parser.add_argument("--fp8", default="off", choices=FP8_SCOPES, help="FP8 projections (fp8_weights)")
    parser.add_argument(
        "--kernels-off",
        default="",
        metavar="NAMES",
        help="Triton kernels (comma-separated) whose PyTorch formulas run instead, to measure them",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, print the N costliest kernels of an eager frame step and codec call per batch",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    turn_off(device, [name for name in args.kernels_off.split(",") if name])
    checkpoint = args.checkpoint or make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    config = load_config(checkpoint)
    backbone = load_backbone(checkpoint, config, device=device, dtype=dtype)
    quantize_backbone(backbone, args.fp8)
    codec = load_codec(checkpoint, config, device=device, dtype=dtype)
    prompts = PromptBuilder(config, TextTokenizer(checkpoint))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    runner = ModelRunner(backbone, max(batches), args.context + 64, 64)
    if args.graphs:
        runner.capture_graphs(batches, [args.context])
    talker = backbone.talker
    rows = []
    for batch in batches:
        span = fill_rows(runner, config, prompts, batch, args.context, args.spread)
        positions = runner.state.position[:batch].clone()
        hidden = runner.state.past_hidden[:batch]
        first = talker.model.codec_embedding(runner.state.last_code[:batch])

        def predictor():
            with torch.inference_mode():
                talker.code_predictor.predict_frame(
                    hidden, first, runner.predictor_cache, lambda logits, group: logits.argmax(-1)
                )

        def talker_step():
            with torch.inference_mode():
                embeds = hidden[:, None]
                talker(embeds, runner.state.position[:batch, None], runner.cache, span)

        def frame_step():
            runner.state.position[:batch] = positions
            runner.decode(batch, span)

        codes = torch.randint(
            0,
            config.codec.codebook_size,
            (batch, args.chunk_frames, config.codec.num_quantizers),
            device=device,
        )
        start = torch.zeros(batch, dtype=torch.long, device=device)
        state = codec.new_state(batch)
        codec_runner = CodecRunner(
            codec, [batch] if args.graphs else None, [args.chunk_frames] if args.graphs else None
        )
        codec_s = timed(lambda: codec_runner.decode(codes, start, state), device, max(3, args.repeat // 2))
        audio_s = batch * args.chunk_frames * config.codec.samples_per_frame / config.codec.sample_rate
        if args.graphs:
            talker_step, predictor = graphed(talker_step, device), graphed(predictor, device)
        row = {
            "batch": batch,
            "talker_step_ms": timed(talker_step, device, args.repeat) * 1e3,
            "predictor_15_steps_ms": timed(predictor, device, args.repeat) * 1e3,
            "frame_step_ms": timed(frame_step, device, args.repeat) * 1e3,
            "codec_ms_per_chunk": codec_s * 1e3,
            "codec_ms_per_audio_s": codec_s * 1e3 / audio_s,
        }
        row["frames_per_s"] = batch / (row["frame_step_ms"] / 1e3)
        row["realtime_streams"] = row["frames_per_s"] / config.frame_rate
        rows.append(row)
        print(
            f"batch {batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "batch"), flush=True
        )
        if args.profile:
            eager_codec = CodecRunner(codec, None, None)
            for name, fn in (
                ("frame step", lambda: runner._decode_into_output(batch, span)),
                (f"codec call ({args.chunk_frames} frames)", lambda: eager_codec.decode(codes, start, state)),
            ):
                print(
                    f"\nbatch {batch}, {name}, eager: top {args.profile} kernels\n"
                    + top_kernels(fn, device, args.profile)
                )

    header = [
        "batch",
        "talker_step_ms",
        "predictor_15_steps_ms",
        "frame_step_ms",
        "frames_per_s",
        "realtime_streams",
        "codec_ms_per_chunk",
        "codec_ms_per_audio_s",
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print(
            "| "
            + " | ".join(f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h]) for h in header)
            + " |"
        )
    meta = {
        "preset": args.preset,
        "device": str(device),
        "dtype": str(dtype),
        "graphs": args.graphs,
        "fp8_weights": args.fp8,
        "kernels_off": args.kernels_off,
        "context": args.context,
        "spread": args.spread,
        "chunk_frames": args.chunk_frames,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
