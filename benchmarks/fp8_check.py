"""FP8 weights (`fp8_weights`) against bf16: logit error, greedy code agreement, frame-step time.

    python benchmarks/fp8_check.py --checkpoint CK --out DIR       # GPU: 1.7B, 500 frames, batch 1/64/256
    python benchmarks/fp8_check.py --preset tiny --device cpu --frames 8 --prompts 2 --batch-sizes 1,2

The same checkpoint is loaded twice, once as is (bf16 on a GPU) and once with its decoder layers'
projections in FP8. Over a fixed set of prompts decoded greedily (`voxtriton.bench.fidelity`):
- logit error, teacher-forced (each FP8 step continues from bf16's codes), per codebook: max and mean
  absolute error, each also relative to bf16's (max |error| / max |bf16|, sum |error| / sum |bf16|),
  and how often the argmax over the codebook's codes agrees;
- code agreement, free-running (each decodes on its own; CUDA graphs on a GPU): per codebook, the
  share of frames whose code agrees, and the first frame at which each prompt's codes differ;
- the frame step (one CUDA graph per batch size), every row at the last position of --context, as
  `benchmarks/model_speed.py` times it.
Checkpoints are random-weight (made with `voxtriton make-checkpoint` unless --checkpoint is given): the
timings are real, the codes are noise, and real weights may agree more or less. Writes fp8_check.json
and fp8_check.md in --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from first_requests import git_commit
from model_speed import fill_rows

from voxtriton.bench import fidelity
from voxtriton.bench.timing import timed
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import quantize_decoder_layers
from voxtriton.models.loader import load_backbone
from voxtriton.models.random_checkpoint import make_checkpoint
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.runtime import resolve_dtype


def frame_step_ms(backbone, config, prompts, batches: list[int], context: int, repeat: int) -> list[float]:
    """Median frame-step time per batch size, every row at position context - 1 (graphs on a GPU)."""
    runner = ModelRunner(backbone, max(batches), context + 64, 64)
    if runner.device.type == "cuda":
        runner.capture_graphs(batches, [context])
    times = []
    for batch in batches:
        span = fill_rows(runner, config, prompts, batch, context, spread=False)
        positions = runner.state.position[:batch].clone()

        def step():
            runner.state.position[:batch] = positions
            runner.decode(batch, span)

        times.append(timed(step, runner.device, repeat) * 1e3)
    return times


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# FP8 weights against bf16",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['hardware']}, torch {meta['torch']}. "
        f"Checkpoint: {meta['checkpoint']} (RANDOM weights: the codes are noise).",
        "",
        f"```\n{meta['command']}\n```",
        "",
        f"{meta['prompts']} prompts, greedy, {meta['frames']} frames; "
        f"{meta['projections']} projections in FP8.",
        "",
        "## Logit error, teacher-forced (codebook 0 = talker head, 1-15 = code predictor heads)",
        "",
        "| codebook | max abs | max abs / max bf16 | mean abs | sum abs / sum bf16 | top-1 agreement |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["logit_error"]:
        lines.append(
            f"| {row['codebook']} | {row['max_abs_error']:.4g} | {row['max_abs_error_rel']:.4f} | "
            f"{row['mean_abs_error']:.4g} | {row['mean_abs_error_rel']:.4f} | {row['top1_agreement']:.4f} |"
        )
    agreement = result["code_agreement"]
    lines += [
        "",
        "## Codes, free-running",
        "",
        f"All codebooks: {agreement['all_codebooks']:.4f} of codes agree; whole frames: "
        f"{agreement['whole_frames']:.4f}. First differing frame per prompt: "
        f"{agreement['first_difference']}.",
        "",
        "| codebook | " + " | ".join(str(i) for i in range(len(agreement["per_codebook"]))) + " |",
        "|---|" + "---|" * len(agreement["per_codebook"]),
        "| agreement | " + " | ".join(f"{share:.3f}" for share in agreement["per_codebook"]) + " |",
        "",
        f"## Frame step (ms), every row at position {meta['context'] - 1}",
        "",
        "| batch | bf16 | FP8 | bf16 / FP8 |",
        "|---|---|---|---|",
    ]
    for row in result["frame_step"]:
        ratio = row["bf16_ms"] / row["fp8_ms"]
        lines.append(f"| {row['batch']} | {row['bf16_ms']:.3f} | {row['fp8_ms']:.3f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="1.7b", choices=("tiny", "0.6b", "1.7b"))
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16"
    )
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--prompts", type=int, default=len(fidelity.TEXTS))
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=512, help="KV positions of the timed frame steps")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    checkpoint = args.checkpoint or make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    config = load_config(checkpoint)
    prompts = PromptBuilder(config, TextTokenizer(checkpoint))
    reference = load_backbone(checkpoint, config, device=device, dtype=dtype)
    candidate = load_backbone(checkpoint, config, device=device, dtype=dtype)
    projections = quantize_decoder_layers(candidate)

    requests = fidelity.greedy_requests(reference, prompts, args.frames, args.prompts)
    positions = fidelity.positions_needed(requests, args.frames)
    graphs = device.type == "cuda"
    codes = [
        fidelity.decode_frames(
            fidelity.new_runner(model, args.prompts, positions, graphs),
            fidelity.greedy_requests(model, prompts, args.frames, args.prompts),
            args.frames,
        )
        for model in (reference, candidate)
    ]
    agreement = fidelity.code_agreement(*codes)
    print(f"free-running codes: {json.dumps(agreement)}", flush=True)
    logit_error = fidelity.teacher_forced_logit_error(
        fidelity.new_runner(reference, args.prompts, positions, graphs=False),
        fidelity.new_runner(candidate, args.prompts, positions, graphs=False),
        requests,
        args.frames,
    )
    for row in logit_error:
        print(f"logit error: {json.dumps(row)}", flush=True)

    batches = [int(b) for b in args.batch_sizes.split(",")]
    times = [
        frame_step_ms(model, config, prompts, batches, args.context, args.repeat)
        for model in (reference, candidate)
    ]
    frame_step = [
        {"batch": batch, "bf16_ms": bf16, "fp8_ms": fp8} for batch, bf16, fp8 in zip(batches, *times)
    ]
    for row in frame_step:
        print(f"frame step: {json.dumps(row)}", flush=True)

    hardware = (
        f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    result = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": git_commit(),
            "hardware": hardware,
            "torch": torch.__version__,
            "command": shlex.join(["python", *sys.argv]),
            "checkpoint": f"{config.model_size} ({checkpoint})",
            "dtype": str(dtype),
            "prompts": args.prompts,
            "frames": args.frames,
            "context": args.context,
            "projections": projections,
            "seconds": round(time.perf_counter() - started, 1),
        },
        "logit_error": logit_error,
        "code_agreement": agreement,
        "frame_step": frame_step,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_check.json").write_text(json.dumps(result, indent=2))
    (args.out / "fp8_check.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
