"""Single-stream time to first audio (TTFA) and real-time factor (RTF), in process, against faster-qwen3-tts.

    python benchmarks/single_stream.py --checkpoint /tmp/ckpt-1.7b --runs 5 --frames 100 --json out.json

Any model family voxtriton serves (the checkpoint's config.json says which); the peer runs for
Qwen3-TTS CustomVoice checkpoints only.

Ours: the serving code of the `tts` model (engine with CUDA graphs, chunk scheduler, codec with
graphs) with both codec lanes in this process instead of behind BLS, so it compares like for like
with the peer, which is a single-process library. Through the full Triton server: serving_bench.py.

Peer: faster-qwen3-tts (PyPI), a CUDA-graph single-stream Qwen3-TTS implementation, on the same
checkpoint. TTFA uses the same first-chunk size (2 frames) on both sides; RTF uses each side's
default chunking (ours 2, 2, 4, 4, 8, 8, 16, 16, 25...; the peer's 12). Checkpoints are random-weight (noise);
length is fixed with ignore_eos / min_new_tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from voxtriton.engine.engine import Engine
from voxtriton.models.families import load_family
from voxtriton.scheduler.policy import BACKGROUND, URGENT, SchedulerConfig
from voxtriton.serving.codec_service import CodecService, InProcessLane
from voxtriton.serving.requests import request_parser
from voxtriton.serving.settings import CodecSettings, TTSSettings
from voxtriton.serving.state_pool import CodecStatePool
from voxtriton.serving.tts_service import TTSService, codec_slots

TEXT = "The quick brown fox jumps over the lazy dog, and then it keeps running for a while."


class TracedEngine(Engine):
    """Records each frame step (start, end, batch) so TTFA can be broken down."""

    def __init__(self, *args, trace: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace = trace

    def step(self, *args, **kwargs):
        started = time.perf_counter()
        outputs = super().step(*args, **kwargs)
        self.trace.append(("step", started, time.perf_counter(), len(outputs)))
        return outputs


class TracedLane:
    def __init__(self, lane, trace: list):
        self.lane, self.trace = lane, trace

    def decode(self, codes, start, slots, prime=False):
        started = time.perf_counter()
        result = self.lane.decode(codes, start, slots, prime)
        self.trace.append(("codec", started, time.perf_counter(), codes.shape[0], codes.shape[1]))
        return result


def ttfa_breakdown(trace: list, submitted: float, first_sent: float) -> dict:
    """Milliseconds from submission to: each of the first frame steps, the first codec call, the send."""
    steps = [e for e in trace if e[0] == "step" and e[2] >= submitted][:3]
    codec = next(e for e in trace if e[0] == "codec" and e[1] >= submitted)

    def ms(t):
        return round((t - submitted) * 1e3, 2)

    return {
        "steps_start_end_ms": [(ms(s), ms(e)) for _, s, e, _ in steps],
        "first_codec_start_end_ms": (ms(codec[1]), ms(codec[2])),
        "first_sent_ms": ms(first_sent),
    }


class TimingSink:
    def __init__(self):
        self.times: list[float] = []
        self.samples = 0
        self.done = threading.Event()
        self.error = None

    def send(self, audio, codes, info, final):
        self.times.append(time.perf_counter())
        self.samples += len(audio)
        if final:
            self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()

    def cancelled(self):
        return False


def run_ours(checkpoint: Path, runs: int, frames: int, device: torch.device) -> dict:
    gpu = device.type == "cuda"
    family = load_family(checkpoint)
    settings = TTSSettings(checkpoint_dir=str(checkpoint), max_streams=8, max_positions=1024)
    backbone = family.load_backbone(device=device, dtype=torch.bfloat16 if gpu else torch.float32)
    runner = family.new_runner(
        backbone, settings.max_streams, settings.max_positions, settings.max_text_tokens
    )
    if gpu:
        runner.capture_graphs(**settings.graph_buckets())
    codec = CodecService(
        CodecSettings(
            checkpoint_dir=str(checkpoint),
            device=str(device),
            dtype="bfloat16" if gpu else "float32",
            high_priority=True,
        )
    )
    parser = request_parser(family, settings)
    trace: list = []
    engine = TracedEngine(runner, settings.max_streams, trace=trace)
    scheduler = SchedulerConfig(single_frame_start_streams=0)  # the peer's first chunk: 2 frames
    pool = CodecStatePool(codec_slots(engine, 8, scheduler), codec.state_size, device)
    lane = TracedLane(InProcessLane(codec, pool.tensor), trace)
    service = TTSService(engine, scheduler, {URGENT: lane, BACKGROUND: lane}, max_queued=8, device=device)
    ttfa, rtf, breakdown = [], [], None
    try:
        for run in range(runs + 1):  # the first run warms up
            inputs = {
                "text": np.array([TEXT.encode()], dtype=object),
                "seed": np.array([run]),
                "max_frames": np.array([frames]),
                "ignore_eos": np.array([True]),
            }
            sink = TimingSink()
            started = time.perf_counter()
            service.submit(parser.parse(f"run{run}", inputs), sink)
            sink.done.wait(300)
            if sink.error:
                raise RuntimeError(sink.error)
            if run:
                breakdown = ttfa_breakdown(trace, started, sink.times[0])
                ttfa.append((sink.times[0] - started) * 1e3)
                rtf.append((sink.times[-1] - started) / (sink.samples / family.sample_rate))
    finally:
        service.shutdown()
        pool.close()
    del service, runner, backbone, codec
    if gpu:
        torch.cuda.empty_cache()
    return {
        "ttfa_ms": ttfa,
        "rtf": rtf,
        "ttfa_ms_median": statistics.median(ttfa),
        "rtf_median": statistics.median(rtf),
        "last_run_ttfa_breakdown": breakdown,
    }


def run_peer(checkpoint: Path, runs: int, frames: int) -> dict:
    try:
        from faster_qwen3_tts import FasterQwen3TTS
    except Exception as error:
        return {"error": f"cannot import faster_qwen3_tts: {error!r}"}
    try:
        model = FasterQwen3TTS.from_pretrained(
            str(checkpoint), device="cuda", dtype=torch.bfloat16, local_files_only=True
        )
        model.warmup(prefill_len=100)
        speaker = sorted(model.model.get_supported_speakers())[0]

        def stream(chunk_size):
            started = time.perf_counter()
            first, samples, rate = None, 0, 24000
            for audio, rate, _ in model.generate_custom_voice_streaming(
                text=TEXT,
                speaker=speaker,
                language="English",
                max_new_tokens=frames,
                min_new_tokens=frames,
                chunk_size=chunk_size,
            ):
                first = first or time.perf_counter()
                samples += len(audio)
            return (first - started) * 1e3, (time.perf_counter() - started) / (samples / rate)

        stream(2)  # warm-up
        ttfa = [stream(2)[0] for _ in range(runs)]
        rtf = [stream(12)[1] for _ in range(runs)]
        return {
            "ttfa_ms": ttfa,
            "rtf": rtf,
            "ttfa_ms_median": statistics.median(ttfa),
            "rtf_median": statistics.median(rtf),
            "speaker": speaker,
        }
    except Exception:
        return {"error": traceback.format_exc(limit=8)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    ours = run_ours(args.checkpoint, args.runs, args.frames, device)
    print(
        "voxtriton:",
        json.dumps({k: v for k, v in ours.items() if "median" in k or "breakdown" in k}),
        flush=True,
    )
    family = load_family(args.checkpoint)
    peer_runs = family.name == "qwen3_tts" and bool(family.speakers)  # the peer's CustomVoice speakers
    peer = (
        {"error": "skipped"}
        if args.skip_peer or device.type != "cuda" or not peer_runs
        else run_peer(args.checkpoint, args.runs, args.frames)
    )
    print(
        "faster-qwen3-tts:",
        json.dumps({k: v for k, v in peer.items() if "median" in k or k == "error"}),
        flush=True,
    )
    result = {
        "ours": ours,
        "peer": peer,
        "meta": {
            "checkpoint": str(args.checkpoint),
            "family": family.name,
            "frames": args.frames,
            "runs": args.runs,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
    }
    if "ttfa_ms_median" in peer:
        result["ttfa_ratio_peer_over_ours"] = peer["ttfa_ms_median"] / ours["ttfa_ms_median"]
        result["rtf_ratio_peer_over_ours"] = peer["rtf_median"] / ours["rtf_median"]
        print(
            f"TTFA: peer / ours = {result['ttfa_ratio_peer_over_ours']:.2f}x; RTF: peer / ours = "
            f"{result['rtf_ratio_peer_over_ours']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
