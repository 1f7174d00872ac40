"""FP8 weights (`fp8_weights`) and the FP8 KV cache (`fp8_kv_cache`) against bf16: logit error, greedy
code agreement, frame-step time, decode-attention time.

    python benchmarks/fp8_check.py --checkpoint CK --out DIR       # GPU: 1.7B, 500 frames, batch 1/64/256
    TRITON_INTERPRET=1 python benchmarks/fp8_check.py --preset tiny --device cpu --frames 8 --prompts 2 \
        --batch-sizes 1,2 --context 64

The same checkpoint is loaded as is (bf16 on a GPU) and once per --variants, each an `fp8_weights`
scope (`talker`: the talker's decoder-layer projections in FP8; `all`: the code predictor's too), a KV
cache (`kv-talker`: the talker's in FP8, `fp8_kv_cache=talker`; `kv`: the code predictor's too,
`fp8_kv_cache=on`), or both joined by `+` (`all+kv`). Over a fixed set of prompts decoded greedily
(`voxtriton.bench.fidelity`), per variant:
- logit error, teacher-forced (each FP8 step continues from bf16's codes), per codebook: max and mean
  absolute error, each also relative to bf16's (max |error| / max |bf16|, sum |error| / sum |bf16|),
  and how often the argmax over the codebook's codes agrees;
- code agreement, free-running (each decodes on its own; CUDA graphs on a GPU): per codebook, the
  share of frames whose code agrees, and the first frame at which each prompt's codes differ;
- the frame step (one CUDA graph per batch size), every row at the last position of --context, as
  `benchmarks/model_speed.py` times it.
And decode attention alone (`decode_attention`, graphed, the talker's head shape from
`benchmarks/attention_speed.py`), bf16 against FP8 keys and values, at each batch size over --context
entries per row (in Triton's interpreter on the CPU, fp32: a smoke run).
Checkpoints are random-weight (made with `voxtriton make-checkpoint` unless --checkpoint is given): the
timings are real, the codes are noise, and real weights may agree more or less. Writes fp8_check.json
and fp8_check.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from attention_speed import CALLS_PER_SAMPLE, case_inputs
from first_requests import git_commit
from model_speed import fill_rows

from voxtriton.bench import fidelity
from voxtriton.bench.timing import graphed, timed
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.kernels.attention import decode_attention, decode_attention_reference
from voxtriton.kernels.fp8 import quantize_rows_reference
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import quantize_backbone
from voxtriton.models.loader import load_backbone
from voxtriton.models.random_checkpoint import make_checkpoint
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.runtime import resolve_dtype
from voxtriton.serving.settings import FP8_SCOPES

# A --variants KV part -> its fp8_kv_cache value
KV_VARIANTS = {"kv-talker": "talker", "kv": "on"}


def parse_variant(name: str) -> tuple[str, str]:
    """(fp8_weights, fp8_kv_cache) of a --variants entry: a scope, a KV part, or SCOPE+KV."""
    scope, kv = "off", "off"
    for part in name.split("+"):
        if part in FP8_SCOPES[1:] and scope == "off":
            scope = part
        elif part in KV_VARIANTS and kv == "off":
            kv = KV_VARIANTS[part]
        else:
            raise ValueError(
                f"{name!r}: {part!r} is not one of {', '.join(FP8_SCOPES[1:] + tuple(KV_VARIANTS))} "
                "(one weights scope and one KV part at most, joined by +)"
            )
    return scope, kv


def frame_step_ms(
    backbone, config, prompts, batches: list[int], context: int, repeat: int, fp8_kv_cache: str = "off"
) -> list[float]:
    """Median frame-step time per batch size, every row at position context - 1 (graphs on a GPU)."""
    runner = ModelRunner(backbone, max(batches), context + 64, 64, fp8_kv_cache=fp8_kv_cache)
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


def attention_us(batches: list[int], context: int, device: torch.device, repeat: int) -> list[dict]:
    """Median decode-attention call (one new token per row, every row at position context - 1) per
    batch size: bf16 (fp32 on the CPU) against FP8 keys and values, each checked against the reference."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    rows = []
    for batch in batches:
        q, keys, values, positions = case_inputs(batch, context, "full", device, dtype)
        (fp8_keys, key_scales), (fp8_values, value_scales) = (
            quantize_rows_reference(t) for t in (keys, values)
        )
        scales = {"key_scales": key_scales[..., 0], "value_scales": value_scales[..., 0]}
        row = {"batch": batch, "span": context}
        for name, (k, v, fp8) in {"bf16": (keys, values, {}), "fp8": (fp8_keys, fp8_values, scales)}.items():
            out = decode_attention(q, k, v, positions, 0.1, **fp8)
            expected = decode_attention_reference(q, k, v, positions, 0.1, **fp8)
            torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)
            calls = graphed(
                lambda: [decode_attention(q, k, v, positions, 0.1, **fp8) for _ in range(CALLS_PER_SAMPLE)],
                device,
            )
            samples = max(1, repeat // CALLS_PER_SAMPLE)
            row[f"{name}_us"] = timed(calls, device, samples) / CALLS_PER_SAMPLE * 1e6
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# FP8 weights and KV cache against bf16",
        "",
        f"{meta['date']}, commit {meta['commit']}, {meta['hardware']}, torch {meta['torch']}. "
        f"Checkpoint: {meta['checkpoint']} (RANDOM weights: the codes are noise).",
        "",
        f"```\n{meta['command']}\n```",
        "",
        f"{meta['prompts']} prompts, greedy, {meta['frames']} frames. Codebook 0 is the talker's head, "
        "1-15 the code predictor's.",
    ]
    for name, found in result["variants"].items():
        agreement = found["code_agreement"]
        lines += [
            "",
            f"## FP8 {name} (fp8_weights {found['fp8_weights']}, {found['projections']} projections; "
            f"fp8_kv_cache {found['fp8_kv_cache']})",
            "",
            "Logit error, teacher-forced:",
            "",
            "| codebook | max abs | max abs / max bf16 | mean abs | sum abs / sum bf16 | top-1 agreement |",
            "|---|---|---|---|---|---|",
        ]
        for row in found["logit_error"]:
            lines.append(
                f"| {row['codebook']} | {row['max_abs_error']:.4g} | {row['max_abs_error_rel']:.4f} | "
                f"{row['mean_abs_error']:.4g} | {row['mean_abs_error_rel']:.4f} | "
                f"{row['top1_agreement']:.4f} |"
            )
        lines += [
            "",
            f"Codes, free-running: {agreement['all_codebooks']:.4f} of codes agree, whole frames "
            f"{agreement['whole_frames']:.4f}; first differing frame per prompt: "
            f"{agreement['first_difference']}.",
            "",
            "| codebook | " + " | ".join(str(i) for i in range(len(agreement["per_codebook"]))) + " |",
            "|---|" + "---|" * len(agreement["per_codebook"]),
            "| agreement | " + " | ".join(f"{share:.3f}" for share in agreement["per_codebook"]) + " |",
        ]
    variants = list(result["variants"])
    lines += [
        "",
        f"## Frame step (ms), every row at position {meta['context'] - 1}",
        "",
        "| batch | bf16 | " + " | ".join(f"FP8 {name} | bf16 / FP8 {name}" for name in variants) + " |",
        "|---|---|" + "---|---|" * len(variants),
    ]
    for row in result["frame_step"]:
        cells = [f"{row[name]:.3f} | {row['bf16'] / row[name]:.2f}" for name in variants]
        lines.append(f"| {row['batch']} | {row['bf16']:.3f} | " + " | ".join(cells) + " |")
    if result["decode_attention"]:
        lines += [
            "",
            f"## Decode attention (us per call), every row at position {meta['context'] - 1}",
            "",
            "One talker layer's call: 16 query heads, 8 KV heads, head size 128, one new token per row.",
            "",
            "| batch | bf16 | FP8 KV | bf16 / FP8 |",
            "|---|---|---|---|",
        ]
        for row in result["decode_attention"]:
            lines.append(
                f"| {row['batch']} | {row['bf16_us']:.1f} | {row['fp8_us']:.1f} | "
                f"{row['bf16_us'] / row['fp8_us']:.2f} |"
            )
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
    parser.add_argument(
        "--variants",
        default="talker,all,kv-talker,kv,all+kv",
        help="compared with bf16: fp8_weights scopes (talker, all), FP8 KV caches (kv-talker, kv), or "
        "one of each joined by +",
    )
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--prompts", type=int, default=len(fidelity.TEXTS))
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=512, help="KV positions of the timed frame steps")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    try:
        variants = {name: parse_variant(name) for name in args.variants.split(",")}
    except ValueError as error:
        parser.error(f"--variants: {error}")

    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    checkpoint = args.checkpoint or make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    config = load_config(checkpoint)
    prompts = PromptBuilder(config, TextTokenizer(checkpoint))
    reference = load_backbone(checkpoint, config, device=device, dtype=dtype)
    requests = fidelity.greedy_requests(reference, prompts, args.frames, args.prompts)
    positions = fidelity.positions_needed(requests, args.frames)
    graphs = device.type == "cuda"

    def free_running(model, fp8_kv_cache="off"):
        runner = fidelity.new_runner(model, args.prompts, positions, graphs, fp8_kv_cache)
        return fidelity.decode_frames(
            runner, fidelity.greedy_requests(model, prompts, args.frames, args.prompts), args.frames
        )

    reference_codes = free_running(reference)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    times = {"bf16": frame_step_ms(reference, config, prompts, batches, args.context, args.repeat)}
    found_by_variant = {}
    for name, (scope, kv) in variants.items():
        candidate = load_backbone(checkpoint, config, device=device, dtype=dtype)
        found = {"fp8_weights": scope, "fp8_kv_cache": kv, "projections": quantize_backbone(candidate, scope)}
        found["code_agreement"] = fidelity.code_agreement(reference_codes, free_running(candidate, kv))
        found["logit_error"] = fidelity.teacher_forced_logit_error(
            fidelity.new_runner(reference, args.prompts, positions, graphs=False),
            fidelity.new_runner(candidate, args.prompts, positions, graphs=False, fp8_kv_cache=kv),
            fidelity.greedy_requests(reference, prompts, args.frames, args.prompts),
            args.frames,
        )
        times[name] = frame_step_ms(candidate, config, prompts, batches, args.context, args.repeat, kv)
        print(f"FP8 {name}: {json.dumps(found)}", flush=True)
        found_by_variant[name] = found
        del candidate
    frame_step = [
        {"batch": batch, **{name: times[name][i] for name in times}} for i, batch in enumerate(batches)
    ]
    for row in frame_step:
        print(f"frame step (ms): {json.dumps(row)}", flush=True)
    attention = []
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        attention = attention_us(batches, args.context, device, args.repeat)
    else:
        print("decode attention not timed: on the CPU it runs in Triton's interpreter (TRITON_INTERPRET=1)")
    for row in attention:
        print(f"decode attention (us): {json.dumps(row)}", flush=True)

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
            "seconds": round(time.perf_counter() - started, 1),
        },
        "variants": found_by_variant,
        "frame_step": frame_step,
        "decode_attention": attention,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_check.json").write_text(json.dumps(result, indent=2))
    (args.out / "fp8_check.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
