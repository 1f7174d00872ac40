"""One stream at a time through faster-qwen3-tts (in process, CUDA graphs): TTFA, RTF and stalls under
the same workload and playback accounting as serving_bench.py's single-stream runs.

    python benchmarks/peers/faster_qwen3_tts/single_stream.py --checkpoint /tmp/ck-1.7b \
        --chunk-sizes 2,12 --duration 20 --json /tmp/fq_single.json

faster-qwen3-tts yields audio every `chunk_size` frames (one size for the whole stream). Each
request's length is fixed as voxtriton's are: min_new_tokens = max_new_tokens = its frames, so random
weights cannot end it early. TTFA runs from the call to the first audio chunk it yields.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from voxtriton.bench.fleet import hardware
from voxtriton.bench.summary import summarize
from voxtriton.bench.targets import played
from voxtriton.bench.workload import draw_utterance

SAMPLE_RATE = 24000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a CustomVoice checkpoint directory")
    parser.add_argument("--chunk-sizes", default="2,12", help="frames per audio chunk, one run each")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of requests per chunk size")
    parser.add_argument("--seconds", default="3,20", help="utterance length range in seconds (uniform)")
    parser.add_argument("--speaker", default="ryan")
    parser.add_argument("--language", default="English")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True, help="where the results go")
    return parser.parse_args(argv)


def stream_once(model, utterance, args, chunk_size: int):
    """One request's audio arrivals: (seconds after the call, audio seconds) per chunk."""
    sent = time.perf_counter()
    arrivals = []
    for audio, sample_rate, _timing in model.generate_custom_voice_streaming(
        text=utterance.text,
        speaker=args.speaker,
        language=args.language,
        max_new_tokens=utterance.frames,
        min_new_tokens=utterance.frames,
        chunk_size=chunk_size,
    ):
        arrivals.append((time.perf_counter() - sent, len(audio) / sample_rate))
    return played(0.0, arrivals, None, asked_s=utterance.seconds)


def run_chunk_size(model, args, chunk_size: int) -> dict:
    rng = random.Random(args.seed)
    seconds_range = tuple(float(s) for s in args.seconds.split(","))
    stream_once(model, draw_utterance(random.Random(-1), seconds_range), args, chunk_size)  # warm-up
    results, started = [], time.perf_counter()
    while time.perf_counter() - started < args.duration:
        results.append(stream_once(model, draw_utterance(rng, seconds_range), args, chunk_size))
    summary = summarize(results, [])
    summary.pop("timeline")
    return {"chunk_size": chunk_size, **summary}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from faster_qwen3_tts import FasterQwen3TTS

    from voxtriton.models.config import load_config

    load_config(Path(args.checkpoint))  # the same checkpoint voxtriton serves, checked by its loader
    model = FasterQwen3TTS.from_pretrained(args.checkpoint, local_files_only=True)
    model.warmup()
    rows = []
    for chunk_size in (int(c) for c in args.chunk_sizes.split(",")):
        row = run_chunk_size(model, args, chunk_size)
        rows.append(row)
        print(
            f"chunk {chunk_size}: {row['requests']} requests, TTFA p50 {row['ttfa_p50_ms']} ms "
            f"p90 {row['ttfa_p90_ms']} ms, RTF {row['rtf_median']:.3f}, {row['stalled_requests']} stalled",
            flush=True,
        )
    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    from importlib.metadata import version

    meta = {
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "hardware": hardware(),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "system": f"faster-qwen3-tts {version('faster-qwen3-tts')}, torch {torch.__version__}",
        "checkpoint": args.checkpoint,
        "duration_s": args.duration,
        "utterance_seconds": args.seconds,
    }
    with open(args.json, "w") as out:
        json.dump({"meta": meta, "single_stream": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
