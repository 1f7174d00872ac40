"""What a cloned voice costs: encoding a reference, and the time to first audio it adds.

1. Encoding, in this process on --device: the speaker encoder (x-vector) and the speech tokenizer's
   encoder (reference codes) over a batch of references of each length in --seconds, batches of
   --batches (the server's encoder thread batches up to 8 recordings), median of --repeats after
   two warm-up calls: each encoder eagerly at the recordings' length and as the server runs it
   (padded to its buckets, CUDA graphs on a GPU), and both as the server runs them (an in-context
   voice: codes and x-vector, on the host); and reading the file (decode; a 24 kHz WAV needs no
   resampling).
2. TTFA through tritonservers over gRPC (voxtriton_client): sequential single streams of one text,
   seed and length (max_frames with ignore_eos), the cases interleaved request by request:
   - preset: a preset speaker of a CustomVoice checkpoint (--preset-checkpoint or --preset-url), the
     baseline with no reference at all;
   - inline x-vector / inline in-context: a --reference-seconds recording of its own in every
     request (WAV bytes; the server keeps the latest references' voices, so a recording it has seen
     would not be encoded again), without and with its transcript;
   - inline in-context, repeated: the same recording in every request, as a client that sends its
     reference each time does: encoded and primed at its first request only;
   - registered x-vector / registered in-context: that recording registered once (the voices
     directory), named in `speaker`.
   --warm-up requests per case go first and are not counted (their TTFA is reported apart). The
   voices are registered before the server starts, so it primes the in-context one's codec state
   before it is ready and every stream of that voice reuses it.
   With --trace the servers write chunk traces (OUT/trace-*.jsonl) and each case's TTFA is split
   at the median into the request's way in (from the client's sending to the tts model taking it:
   building, gRPC, Triton, the Python backend), the server's parts of the first chunk (its voice's
   encoding, prefill and first frames, lane wait, codec, send) and the way back to the client.

The TTFA cases run first and the encoders are timed after them, so this process holds no GPU
context while the servers (MPS clients) run; the voices are registered with the encoders on the CPU,
as `voxtriton voices add` does by default. Servers are started here (Triton launcher, one at a time)
unless --url / --preset-url name running ones; with --url, --voices-dir must be the directory that
server reads (`voxtriton serve --param tts:voices_dir=DIR`). Checkpoints are random-weight: timings
are real, audio is noise.

    # the H200 run (benchmarks/gpu/run_clone.sh makes the checkpoints and runs this)
    python benchmarks/clone_bench.py --checkpoint /tmp/ck-1.7b-base --preset-checkpoint /tmp/ck-1.7b \
        --device cuda --out results/clone
    # CPU smoke test (tiny random checkpoints, a few requests): what the test suite runs
    python benchmarks/clone_bench.py --smoke --out /tmp/clone
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from first_requests import git_commit
from voxtriton_client import TTSClient

from voxtriton.bench.chunk_trace import FIRST_CHUNK_PARTS, read_trace
from voxtriton.bench.fleet import hardware
from voxtriton.bench.server_metrics import codec_primings
from voxtriton.bench.summary import percentile
from voxtriton.bench.timing import timed
from voxtriton.models.config import load_config
from voxtriton.models.families import load_family
from voxtriton.serving.launcher import TritonServer, parse_params
from voxtriton.serving.reference_audio import SAMPLE_RATE, read_reference_audio
from voxtriton.serving.voices import VoiceEncoder, VoiceStore

TEXT = "A cloned voice reads this sentence, and the listener hears it start."
REFERENCE_TEXT = "The words that were spoken in the reference recording."
XVECTOR, IN_CONTEXT = "bench-xvector", "bench-in-context"  # the registered voices' names
CASES = (
    "preset",
    "inline x-vector",
    "inline in-context",
    "inline in-context, repeated",
    "registered x-vector",
    "registered in-context",
)


def reference_wave(seconds: float, seed: int = 0) -> np.ndarray:
    """A voiced-like signal at 24 kHz: harmonics of a gliding pitch, a syllable rhythm, a little noise."""
    t = np.arange(int(SAMPLE_RATE * seconds)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / SAMPLE_RATE
    wave = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.25 * wave + 0.01 * noise).astype(np.float32)


def wav_bytes(wave: np.ndarray) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@torch.inference_mode()
def encoding_costs(encoder: VoiceEncoder, seconds: list[float], batches: list[int], repeats: int) -> list:
    rows = []
    for length in seconds:
        recording = wav_bytes(reference_wave(length))
        read_ms = timed(lambda: read_reference_audio(recording), torch.device("cpu"), repeats) * 1e3
        for batch in batches:
            wave_list = [reference_wave(length, seed) for seed in range(batch)]
            waves = torch.from_numpy(np.stack(wave_list)).to(encoder.device)
            costs = {}
            for name, runner in (("speaker", encoder.speaker_encoder), ("speech", encoder.speech_encoder)):
                eager = timed(lambda: runner.model(waves), encoder.device, repeats)
                served = timed(lambda: runner.run(wave_list), encoder.device, repeats)
                costs[f"{name}_encoder_eager_ms"] = round(eager * 1e3, 3)
                costs[f"{name}_encoder_ms"] = round(served * 1e3, 3)
            texts = [REFERENCE_TEXT] * batch
            encode_ms = timed(lambda: encoder.encode(wave_list, texts), encoder.device, repeats) * 1e3
            reference_s = batch * length
            rows.append(
                {
                    "seconds": length,
                    "batch": batch,
                    "read_ms": round(read_ms, 3),
                    **costs,
                    "encode_ms": round(encode_ms, 3),
                    "ms_per_reference_second": round(encode_ms / reference_s, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def register(voices_dir: Path, encoder: VoiceEncoder, family, recording: bytes) -> None:
    store = VoiceStore(voices_dir, family)
    waveform = read_reference_audio(recording)
    for name, text in ((XVECTOR, None), (IN_CONTEXT, REFERENCE_TEXT)):
        store.add(name, encoder.encode([waveform], [text])[0], replace=True)


@contextlib.contextmanager
def served(url: str | None, checkpoint: str | None, args, parameters: dict, trace: Path | None = None):
    """(grpc url, metrics reader or None): a running server's, or one started here for the block,
    writing its chunk trace to `trace` if given (read it once the block has ended: the server keeps
    it buffered until it stops)."""
    if url:
        yield url, None
        return
    for model, values in parse_params(args.param).items():
        parameters.setdefault(model, {}).update(values)
    if trace is not None:
        trace.unlink(missing_ok=True)
        parameters.setdefault("tts", {})["chunk_trace_path"] = str(trace)
    server = TritonServer(
        checkpoint=checkpoint, policy=args.policy, tritonserver=args.tritonserver, parameters=parameters
    )
    with server:
        yield server.grpc_url, server.metrics


def ttfa_ms(url: str, args, options: dict | Callable[[], dict]) -> tuple[float, float]:
    """One request's TTFA and when it was sent (on time.perf_counter's clock, which on Linux is the
    server trace's time.monotonic); `options` (or what calling it gives, per request) go with it."""
    options = options() if callable(options) else options
    synthesis = (
        TTSClient(url)
        .synthesize(TEXT, seed=args.seed, max_frames=args.frames, ignore_eos=True, **options)
        .raise_for_error()
    )
    return synthesis.chunks[0].arrived_s * 1e3, synthesis.sent_at


def measure_cases(url: str, cases: dict[str, dict], args) -> dict[str, dict]:
    """Each case's warm-up requests, then --requests rounds of one request per case; per case the
    measured TTFAs and when each request was sent."""
    found = {name: {"first_ms": None, "ttfa_ms": [], "sent": []} for name in cases}
    for name, options in cases.items():
        for index in range(args.warm_up):
            ms, _ = ttfa_ms(url, args, options)
            if index == 0:
                found[name]["first_ms"] = round(ms, 3)
    for _ in range(args.requests):
        for name, options in cases.items():
            ms, sent = ttfa_ms(url, args, options)
            found[name]["ttfa_ms"].append(ms)
            found[name]["sent"].append(sent)
    return found


def ttfa_parts(found: dict[str, dict], trace: Path) -> dict[str, dict]:
    """Per case, the median of each part of TTFA (ms): `way_in` from the client's sending to the tts
    model taking the request, the server's first-chunk parts (chunk_trace's FIRST_CHUNK_PARTS), and
    `way_back` from the server's send to the client's first audio. Beside them, two spans within
    `generate`: `first_step`, the first frame step's period (the prefill's GPU time and what ran
    beside it slow it), and for in-context voices `priming`, from the service taking the request
    to its codec state's priming ending (a kept state's copy, or a codec call on the urgent lane).
    The requests ran one at a time, so a request's first chunk is the first one to arrive after it
    was sent, and its first frame step the first after it was taken."""
    records = read_trace(trace)
    firsts = sorted(
        (r for r in records if r.get("kind") == "chunk" and r["index"] == 0), key=lambda r: r["arrived"]
    )
    arrivals = [r["arrived"] for r in firsts]
    steps = sorted((r for r in records if r.get("kind") == "step" and r["frames"]), key=lambda r: r["end"])
    step_ends = [r["end"] for r in steps]
    parts = {}
    for name, case in found.items():
        rows = collections.defaultdict(list)
        for ms, sent in zip(case["ttfa_ms"], case["sent"]):
            record = firsts[bisect.bisect_left(arrivals, sent)]
            rows["way_in"].append(record["arrived"] - sent)
            for part, measure in FIRST_CHUNK_PARTS.items():
                rows[part].append(measure(record))
            rows["way_back"].append(ms / 1e3 - (record["sent"] - sent))
            rows["first_step"].append(steps[bisect.bisect_right(step_ends, record["submitted"])]["period"])
            if record.get("primed") is not None:
                rows["priming"].append(record["primed"] - record["submitted"])
        parts[name] = {part: round(statistics.median(values) * 1e3, 2) for part, values in rows.items()}
    return parts


def settled_primings(metrics, timeout: float = 10.0) -> dict[str, float]:
    """The server's priming counts once two reads 0.5 s apart agree: its metrics thread writes every
    0.1 s, later on a loaded host."""
    counts, deadline = codec_primings(metrics()), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        counts, previous = codec_primings(metrics()), counts
        if counts == previous:
            break
    return counts


def ttfa_cases(args, recording: bytes, family) -> tuple[list, dict | None]:
    voices_dir = Path(args.voices_dir or Path(args.out) / "voices")
    # Registered on the CPU, as `voxtriton voices add` does by default (see main for why).
    register(voices_dir, VoiceEncoder(family, "cpu"), family, recording)
    seeds = itertools.count(1)

    def new_recording() -> bytes:  # the same length and kind, other samples
        return wav_bytes(reference_wave(args.reference_seconds, seed=next(seeds)))

    clones = {
        "inline x-vector": lambda: {"reference_audio": new_recording()},
        "inline in-context": lambda: {"reference_audio": new_recording(), "reference_text": REFERENCE_TEXT},
        "inline in-context, repeated": {"reference_audio": recording, "reference_text": REFERENCE_TEXT},
        "registered x-vector": {"speaker": XVECTOR},
        "registered in-context": {"speaker": IN_CONTEXT},
    }
    found, parts = {}, {}
    trace = Path(args.out).resolve() / "trace-base.jsonl" if args.trace else None
    parameters = {"tts": {"voices_dir": str(voices_dir)}}
    with served(args.url, args.checkpoint, args, parameters, trace) as (url, metrics):
        before = codec_primings(metrics()) if metrics else None
        found |= measure_cases(url, clones, args)
        after = settled_primings(metrics) if metrics else None
    if trace is not None:
        parts |= ttfa_parts(found, trace)
    counted = None if before is None else {state: after[state] - before[state] for state in before}
    if args.preset_checkpoint or args.preset_url:
        preset = {"preset": {"speaker": args.preset_speaker} if args.preset_speaker else {}}
        trace = Path(args.out).resolve() / "trace-preset.jsonl" if args.trace else None
        with served(args.preset_url, args.preset_checkpoint, args, {}, trace) as (url, _):
            found |= measure_cases(url, preset, args)
        if trace is not None:
            parts |= ttfa_parts({"preset": found["preset"]}, trace)
    rows = []
    baseline = statistics.median(found["preset"]["ttfa_ms"]) if "preset" in found else None
    for name in CASES:
        if name not in found:
            continue
        values = found[name]["ttfa_ms"]
        p50 = statistics.median(values)
        rows.append(
            {
                "case": name,
                "requests": len(values),
                "ttfa_p50_ms": round(p50, 3),
                "ttfa_p90_ms": round(percentile(values, 90), 3),
                "first_warm_up_ms": found[name]["first_ms"],
                "p50_over_preset_ms": None if baseline is None else round(p50 - baseline, 3),
                "parts_ms": parts.get(name),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows, counted


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Voice cloning costs ({meta['date']}, commit {meta['commit']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Hardware: {meta['hardware']}. Checkpoints: {meta['checkpoint']}"
        + (f", preset baseline {meta['preset_checkpoint']}" if meta["preset_checkpoint"] else "")
        + " (random weights: timings are real, audio is noise).",
        "",
        f"## Encoding on {meta['device']} (median of {meta['repeats']})",
        "",
        "Each encoder eagerly at the recordings' length, and as served (padded to its buckets; CUDA "
        "graphs on a GPU); both as served: an in-context voice's codes and x-vector, on the host.",
        "",
        "| reference s | batch | read file ms (one) | speaker encoder ms, eager | as served | "
        "speech encoder ms, eager | as served | both as served ms | ms per reference second |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["encoding"]:
        lines.append(
            f"| {row['seconds']:g} | {row['batch']} | {row['read_ms']} | {row['speaker_encoder_eager_ms']} | "
            f"{row['speaker_encoder_ms']} | {row['speech_encoder_eager_ms']} | {row['speech_encoder_ms']} | "
            f"{row['encode_ms']} | {row['ms_per_reference_second']} |"
        )
    if report["ttfa"]:
        lines += [
            "",
            f"## TTFA, sequential single streams ({meta['reference_seconds']:g} s reference, "
            f"{meta['frames']} frames, policy {meta['policy']})",
            "",
            "| case | requests | TTFA p50 ms | p90 ms | first warm-up ms | p50 over preset ms |",
            "|---|---|---|---|---|---|",
        ]
        for row in report["ttfa"]:
            over = "-" if row["p50_over_preset_ms"] is None else row["p50_over_preset_ms"]
            lines.append(
                f"| {row['case']} | {row['requests']} | {row['ttfa_p50_ms']} | {row['ttfa_p90_ms']} | "
                f"{row['first_warm_up_ms']} | {over} |"
            )
        traced = [row for row in report["ttfa"] if row.get("parts_ms")]
        if traced:
            names = list(dict.fromkeys(name for row in traced for name in row["parts_ms"]))
            lines += [
                "",
                "Where each case's TTFA goes (medians, ms; `way_in`: from the client's sending to the tts "
                "model taking the request; `submit`: its reference's decoding and encoding; "
                "`generate`: prefill and the first chunk's frames; `way_back`: the server's send to "
                "the client's first audio; within `generate`, `first_step`: the first frame step's "
                "period, and `priming`: until an in-context voice's codec state was primed):",
                "",
                "| case | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for row in traced:
                cells = " | ".join(str(row["parts_ms"].get(name, "-")) for name in names)
                lines.append(f"| {row['case']} | {cells} |")
        if report["codec_primings"] is not None:
            lines += [
                "",
                "Codec primings during the TTFA runs (`voxtriton_codec_primings_total`): "
                f"{report['codec_primings']['decoded']:g} decoded, "
                f"{report['codec_primings']['reused']:g} reused.",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", help="the Base checkpoint (encoders; the server started here)")
    parser.add_argument("--preset-checkpoint", help="a CustomVoice checkpoint for the preset baseline")
    parser.add_argument("--url", help="a running server of --checkpoint (gRPC HOST:PORT)")
    parser.add_argument("--preset-url", help="a running server of a CustomVoice checkpoint")
    parser.add_argument("--preset-speaker", help="the baseline's speaker (default: the server's)")
    parser.add_argument("--voices-dir", help="where the voices are registered (default: OUT/voices)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seconds", default="3,10,30", help="reference lengths to encode")
    parser.add_argument("--batches", default="1,8", help="batch sizes to encode")
    parser.add_argument("--repeats", type=int, default=20, help="timed encoder calls per shape")
    parser.add_argument("--reference-seconds", type=float, default=10.0, help="the TTFA cases' reference")
    parser.add_argument("--requests", type=int, default=30, help="measured requests per TTFA case")
    parser.add_argument("--warm-up", type=int, default=3, help="uncounted requests per case first")
    parser.add_argument("--frames", type=int, default=25, help="frames per request (12.5 per second)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="voxserve")
    parser.add_argument(
        "--param", action="append", default=[], help="MODEL:KEY=VALUE for servers started here"
    )
    parser.add_argument("--tritonserver", help="tritonserver binary (default: as `voxtriton serve` finds it)")
    parser.add_argument("--no-ttfa", action="store_true", help="only the encoding costs (no server)")
    parser.add_argument(
        "--trace", action="store_true", help="split each case's TTFA with the servers' chunk traces"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny random checkpoints, a few requests")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        from voxtriton.models.random_checkpoint import make_checkpoint

        made = Path(tempfile.mkdtemp())
        args.checkpoint = args.checkpoint or str(make_checkpoint("tiny-base", made / "tiny-base"))
        if not args.preset_url:
            args.preset_checkpoint = args.preset_checkpoint or str(make_checkpoint("tiny", made / "tiny"))
        args.device, args.seconds, args.batches, args.repeats = "cpu", "1.5,3", "1,2", 2
        args.reference_seconds, args.requests, args.warm_up, args.frames = 2.0, 2, 1, 8
    if not args.checkpoint:
        parser.error("--checkpoint is required (the Base checkpoint; or --smoke)")
    config = load_config(Path(args.checkpoint))
    family = load_family(Path(args.checkpoint))
    if not config.clones_voices:
        parser.error(f"--checkpoint: {args.checkpoint} is {config.model_type}, not a Base checkpoint")
    if args.trace and (args.url or args.preset_url):
        parser.error("--trace needs servers started here (no --url / --preset-url): they write the traces")
    if args.url and not args.voices_dir:
        parser.error("--url: give --voices-dir, the voices directory that server reads")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds = [float(x) for x in args.seconds.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    report = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "commit": git_commit(),
            "hardware": hardware(),
            "command": " ".join(["python", *sys.argv]),
            "checkpoint": args.checkpoint,
            "preset_checkpoint": args.preset_checkpoint or args.preset_url,
            "device": args.device,
            "repeats": args.repeats,
            "reference_seconds": args.reference_seconds,
            "frames": args.frames,
            "policy": args.policy,
            "text": TEXT,
        },
        "encoding": [],
        "ttfa": [],
        "codec_primings": None,
    }
    if not args.no_ttfa:  # first: this process holds no GPU context while the servers (MPS clients) run
        recording = wav_bytes(reference_wave(args.reference_seconds))
        report["ttfa"], report["codec_primings"] = ttfa_cases(args, recording, family)
        save(report, out)  # kept if the encoders' part is cut short
    encoder = VoiceEncoder(family, args.device, graphs=True)  # as the server runs it
    report["encoding"] = encoding_costs(encoder, seconds, batches, args.repeats)
    save(report, out)
    print(markdown(report))


def save(report: dict, out: Path) -> None:
    (out / "clone_bench.json").write_text(json.dumps(report, indent=2))
    (out / "clone_bench.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
