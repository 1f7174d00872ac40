"""The listener's experience under load: Poisson arrivals over gRPC streaming, per policy.

    # open loop: Poisson arrivals at each rate for --duration seconds, every policy, server restarted per policy
    python benchmarks/serving_bench.py --checkpoint DIR --policies voxserve,concurrent,serial --rates 2,4,8 --out results/x
    # goodput: the highest rate with p90 TTFA <= 200 ms and no stalled request, found by bisection
    python benchmarks/serving_bench.py --checkpoint DIR --goodput --rate-low 1 --rate-high 64 --out results/x
    # closed loop: N concurrent streams at all times (lane behaviour at 8, 32, 128 streams)
    python benchmarks/serving_bench.py --checkpoint DIR --concurrency 8,32,128 --out results/x
    # CPU smoke test (tiny random checkpoint, under a minute): what the test suite runs
    python benchmarks/serving_bench.py --smoke --out /tmp/smoke

Workload: utterances of U(3, 20) seconds of audio (max_frames at 12.5 frames/s with ignore_eos, so
random weights behave like real ones), texts drawn from TEXTS, arrival gaps from a Gamma
distribution with mean 1/rate and shape 1/burstiness**2 (burstiness 1 = Poisson).

Metrics (client side, ../shared/design.md): TTFA = request sent to first audio received; stall =
simulated playback that starts at the first chunk; RTF = generation time / audio duration. The
client measures its own event-loop lag, so it can show it was not the bottleneck. Server-side
numbers (frame step time, lane latencies, share of urgent chunks) come from the metrics endpoint.
Checkpoints are random-weight: timings are real, audio is noise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from voxtriton_client import simulate_playback  # noqa: E402

from voxtriton.kernels import FALLBACK_WARNING  # noqa: E402
from voxtriton.serving.gateway import Router  # noqa: E402
from voxtriton.serving.launcher import TritonServer, parse_params  # noqa: E402
from voxtriton.serving.tts_service import LANE_CODES  # noqa: E402

TEXTS = [
    "Good morning, and welcome to the show.",
    "The weather today will be mostly sunny with a light breeze.",
    "Please hold while I connect you to the next available agent.",
    "Your order has shipped and should arrive soon.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Turn left at the next intersection, then continue straight for two kilometres.",
    "The meeting has been moved to Thursday afternoon at three o'clock.",
    "Streaming speech should start fast and never stall, even under heavy load.",
]
FRAME_RATE = 12.5
TTFA_TARGET_S = 0.2
# A stream with no final response by then counts as failed (with that error), so a server that stops
# answering ends a probe instead of hanging it (a 20 s utterance takes about 12 s near the goodput).
REQUEST_TIMEOUT_S = 180.0
TIMELINE_WINDOW_S = 2.0  # each probe's timeline: requests, stalls and p90 TTFA per 2 s of arrivals
LANES = tuple(sorted(LANE_CODES, key=LANE_CODES.get))  # chunk_info's lane codes, in order


@dataclass
class RequestResult:
    sent_at: float
    ttfa_s: float | None
    stall_s: float
    audio_s: float
    rtf: float | None
    error: str | None
    late: tuple[
        tuple[int, str], ...
    ] = ()  # (chunk index, codec lane) of each chunk that arrived after the buffer ran dry


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Progress:
    """A bar redrawn in place on a terminal; into a log file (no terminal), one line per tenth."""

    def __init__(self, label: str, total: float):
        self.label, self.total, self.started = label, total, time.monotonic()
        self.redraw, self.tenths_shown = sys.stderr.isatty(), -1

    def update(self, done: float, note: str = "") -> None:
        width = 30
        fraction = min(1.0, done / self.total) if self.total else 1.0
        filled = int(width * fraction)
        bar = f"{self.label} [{'#' * filled}{'.' * (width - filled)}]"
        if self.redraw:
            sys.stderr.write(f"\r{bar} {note:<40}")
        elif int(fraction * 10) > self.tenths_shown:
            self.tenths_shown = int(fraction * 10)
            sys.stderr.write(f"{bar} {note}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.redraw:
            sys.stderr.write("\n")


async def one_request(
    client: Router, rng: random.Random, seconds_range, speaker: str | None, timeout: float = REQUEST_TIMEOUT_S
) -> RequestResult:
    seconds = rng.uniform(*seconds_range)
    frames = max(1, round(seconds * FRAME_RATE))
    sent = time.perf_counter()
    try:
        synthesis = await asyncio.wait_for(
            client.synthesize(
                rng.choice(TEXTS),
                speaker=speaker,
                seed=rng.randrange(2**31),
                max_frames=frames,
                ignore_eos=True,
                info=True,
            ),
            timeout,
        )
    except asyncio.TimeoutError:
        return RequestResult(sent, None, 0.0, 0.0, None, f"no final response within {timeout:g} s")
    except Exception as error:  # connection-level failures count as failed requests
        return RequestResult(sent, None, 0.0, 0.0, None, repr(error))
    report = simulate_playback(0.0, [(c.arrived_s, c.seconds) for c in synthesis.chunks])
    last = synthesis.chunks[-1].arrived_s if synthesis.chunks else None
    error = synthesis.error or (None if synthesis.completed else "stream ended without its final response")
    late = tuple((i, LANES[int(synthesis.chunks[i].info[3])]) for i in report.late_chunks)
    return RequestResult(
        sent,
        report.ttfa_s,
        report.stall_s,
        report.audio_s,
        last / report.audio_s if last and report.audio_s else None,
        error,
        late,
    )


async def loop_lag(samples: list[float], stop: asyncio.Event, interval: float = 0.01) -> None:
    """How late the event loop wakes up: if this grows, the client, not the server, is the bottleneck."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(interval)
        samples.append(time.perf_counter() - start - interval)


async def open_loop(
    urls: list[str],
    rate: float,
    duration: float,
    burstiness: float,
    seconds_range,
    seed: int,
    speaker: str | None,
    progress: Progress | None = None,
) -> tuple[list[RequestResult], list[float]]:
    rng = random.Random(seed)
    shape = 1.0 / burstiness**2
    lag: list[float] = []
    stop = asyncio.Event()
    client = Router(urls)  # least-loaded over the servers, as the gateway routes
    try:
        lag_task = asyncio.create_task(loop_lag(lag, stop))
        tasks = []
        start = time.perf_counter()
        next_at = 0.0
        while next_at < duration:
            delay = start + next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(one_request(client, random.Random(rng.random()), seconds_range, speaker))
            )
            if progress:
                progress.update(next_at, f"{len(tasks)} sent")
            next_at += rng.gammavariate(shape, 1.0 / (rate * shape))
        results = await asyncio.gather(*tasks)
        stop.set()
        await lag_task
    finally:
        await client.close()
    return list(results), lag


async def closed_loop(
    urls: list[str], streams: int, duration: float, seconds_range, seed: int, speaker: str | None
) -> tuple[list[RequestResult], list[float]]:
    rng = random.Random(seed)
    lag: list[float] = []
    stop = asyncio.Event()
    results: list[RequestResult] = []
    client = Router(urls)
    try:
        lag_task = asyncio.create_task(loop_lag(lag, stop))
        end = time.perf_counter() + duration

        async def worker(index: int):
            local = random.Random(rng.random() + index)
            while time.perf_counter() < end:
                results.append(await one_request(client, local, seconds_range, speaker))

        await asyncio.gather(*(worker(i) for i in range(streams)))
        stop.set()
        await lag_task
    finally:
        await client.close()
    return results, lag


def peak_listeners(results: list[RequestResult]) -> int:
    """Most listeners playing at once: each plays from its first audio to the end of its audio
    (stalls included), on the client's clock."""
    events = []
    for r in results:
        if r.error is None and r.ttfa_s is not None:
            start = r.sent_at + r.ttfa_s
            events += [(start, 1), (start + r.audio_s + r.stall_s, -1)]
    playing = peak = 0
    for _, change in sorted(events):  # at equal times an end (-1) sorts before a start
        playing += change
        peak = max(peak, playing)
    return peak


def timeline(results: list[RequestResult], window_s: float = TIMELINE_WINDOW_S) -> list[dict]:
    """Per window of send time, from the probe's first request: the requests sent in it, how many of
    them stalled or failed, and their p90 TTFA. A request counts in the window it was sent in, even
    if it stalled seconds later, so this dates a collapse by the arrivals it hit, and shows how many
    arrived just before (the aggregates of a collapsed probe can look like a passing one's)."""
    if not results:
        return []
    origin = min(r.sent_at for r in results)
    windows = collections.defaultdict(list)
    for r in results:
        windows[int((r.sent_at - origin) // window_s)].append(r)
    rows = []
    for index in range(max(windows) + 1):
        sent = windows.get(index, [])
        ok = [r for r in sent if r.error is None]
        ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
        rows.append(
            {
                "start_s": index * window_s,
                "requests": len(sent),
                "failed": len(sent) - len(ok),
                "stalled": sum(r.stall_s > 0 for r in ok),
                "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
            }
        )
    return rows


def summarize(results: list[RequestResult], lag: list[float]) -> dict:
    ok = [r for r in results if r.error is None]
    ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    stalled = [r for r in ok if r.stall_s > 0]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttfa_p50_ms": _ms(percentile(ttfa, 50)),
        "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
        "ttfa_p99_ms": _ms(percentile(ttfa, 99)),
        "stalled_requests": len(stalled),
        "stalled_fraction": len(stalled) / len(ok) if ok else None,
        "stall_total_s": sum(r.stall_s for r in ok),
        # Where stalls start: late chunks by their position in the stream (0 is the first) and by lane.
        "late_chunks_by_index": dict(sorted(collections.Counter(i for r in ok for i, _ in r.late).items())),
        "late_chunks_by_lane": dict(collections.Counter(lane for r in ok for _, lane in r.late)),
        "rtf_median": statistics.median(rtf) if rtf else None,
        "audio_s": sum(r.audio_s for r in ok),
        "listeners_peak": peak_listeners(results),
        "client_loop_lag_p99_ms": _ms(percentile(lag, 99)),
        "client_loop_lag_max_ms": _ms(max(lag) if lag else None),
        "timeline": timeline(results),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def meets_target(summary: dict) -> bool:
    return (
        summary["failed"] == 0
        and summary["stalled_requests"] == 0
        and summary["ttfa_p90_ms"] is not None
        and summary["ttfa_p90_ms"] <= TTFA_TARGET_S * 1e3
    )


def server_side(before: dict, after: dict, wall_s: float, servers: int = 1) -> dict:
    """Differences of voxtriton's counters and histograms (summed over `servers` servers) over one
    measurement of `wall_s` seconds."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(name, labels=""):
        count = delta.get(f"{name}_count{labels}", 0.0)
        return round(delta.get(f"{name}_sum{labels}", 0.0) / count * 1e3, 3) if count else None

    chunks = {lane: delta.get(f'voxtriton_chunks_total{{lane="{lane}"}}', 0.0) for lane in LANES}
    total = sum(chunks.values())
    steps = delta.get("voxtriton_frame_step_seconds_count", 0.0)
    admitted = delta.get("voxtriton_admitted_requests_total", 0.0)

    def per_admission(name):  # None where nothing was counted (the GPU time, on CPU)
        return round(delta[name] / admitted * 1e3, 3) if admitted and delta.get(name) else None

    return {
        "frame_step_ms_mean": mean("voxtriton_frame_step_seconds"),
        "frame_step_device_ms_mean": mean("voxtriton_frame_step_device_seconds"),  # GPU only
        # The frame step's wall time split (per step): prefill of new prompts, decode (launch to codes
        # on the host; the device time above is part of it), the rest (locks, bookkeeping, GIL waits).
        "frame_step_parts_ms_mean": {
            part: round(
                delta.get(f'voxtriton_frame_step_part_seconds_total{{part="{part}"}}', 0.0) / steps * 1e3, 3
            )
            if steps
            else None
            for part in ("admit", "decode", "other")
        },
        # The engine thread's CPU time per step outside the decode: admit and other beyond it were waits
        # (for the GIL, the service lock, a CPU).
        "frame_step_host_cpu_ms_mean": (
            round(delta["voxtriton_frame_step_host_cpu_seconds_total"] / steps * 1e3, 3)
            if steps and "voxtriton_frame_step_host_cpu_seconds_total" in delta
            else None
        ),
        # The engine thread's wall time and the GPU's time (before the decode) per admitted request.
        "admit_ms_per_request": per_admission('voxtriton_frame_step_part_seconds_total{part="admit"}'),
        "prefill_device_ms_per_request": per_admission("voxtriton_prefill_device_seconds_total"),
        "frame_step_batch_mean": (
            delta.get("voxtriton_frame_step_batch_sum", 0.0) / delta["voxtriton_frame_step_batch_count"]
            if delta.get("voxtriton_frame_step_batch_count")
            else None
        ),
        "codec_ms_mean": {lane: mean("voxtriton_codec_seconds", f'{{lane="{lane}"}}') for lane in chunks},
        "first_chunk_codec_ms_mean": mean("voxtriton_first_chunk_codec_seconds"),
        "chunks": chunks,
        "urgent_share": (chunks["urgent"] / total) if total else None,
        "promoted_chunks": delta.get(
            "voxtriton_chunks_promoted_total", 0.0
        ),  # background -> urgent (voxserve)
        # Per lane: calls, chunks and frames per call (batch occupancy), and the share of the
        # measurement the lane spent decoding (near 1: the lane is saturated).
        "codec_lanes": {
            lane: codec_lane(delta, lane, chunks[lane], wall_s * servers)
            for lane in LANES
            if delta.get(f'voxtriton_codec_calls_total{{lane="{lane}"}}')
        },
        "codec_models": triton_codec_models(delta),
        "server_ttfa_ms_mean": mean("voxtriton_ttfa_seconds"),
        "deadline_misses": delta.get("voxtriton_deadline_misses_total", 0.0),
        "rejected": delta.get("voxtriton_rejected_requests_total", 0.0),
        "cancellation_watcher": cancellation_watcher(delta, wall_s * servers),
    }


def cancellation_watcher(delta: dict, server_seconds: float) -> dict:
    """The cancellation watcher's checks per second and per server, the microseconds each took
    (holding the service lock), and the share of the measurement it held that lock: the engine
    thread and the codec lanes wait for it meanwhile."""
    if "voxtriton_cancellation_checks_total" not in delta or not server_seconds:  # (a server without them)
        return {"checks_per_s": None, "us_per_check": None, "lock_share": None}
    checks = delta["voxtriton_cancellation_checks_total"]
    held = delta["voxtriton_cancellation_lock_seconds_total"]
    return {
        "checks_per_s": round(checks / server_seconds, 1),
        "us_per_check": round(held / checks * 1e6, 1) if checks else None,
        "lock_share": round(held / server_seconds, 6),
    }


def triton_codec_models(delta: dict) -> dict:
    """Per codec model, Triton's own count of its calls and their mean ms: waiting in its queue (a
    lane's second call in flight waits there for the first), in the model's execution (the codec
    process's work and its round trip), and end to end. A lane times a call from when the codec was
    free (`_call_span`), so its mean call time (`codec_ms_mean`) less the execution time
    approximates what a call cost the tts process beyond Triton: the BLS round trip and getting the
    GIL back."""
    models = {}
    for key, calls in delta.items():
        match = re.match(r'nv_inference_exec_count(\{model="codec[^"]*",version="[^"]*"\})$', key)
        if match and calls:
            labels = match.group(1)

            def per_call(part):
                return round(delta.get(f"nv_inference_{part}_duration_us{labels}", 0.0) / calls / 1e3, 3)

            models[re.search(r'model="([^"]*)"', labels).group(1)] = {
                "calls": calls,
                "queue_ms": per_call("queue"),
                "execute_ms": per_call("compute_infer"),
                "request_ms": per_call("request"),
            }
    return models


def codec_lane(delta: dict, lane: str, chunks: float, lane_seconds: float) -> dict:
    """One lane's calls, occupancy and busy share; `lane_seconds`: the measurement's wall time times
    the servers whose counters were summed."""
    calls = delta[f'voxtriton_codec_calls_total{{lane="{lane}"}}']
    return {
        "calls": calls,
        "chunks_per_call": round(chunks / calls, 2),
        "frames_per_call": round(delta.get(f'voxtriton_codec_frames_total{{lane="{lane}"}}', 0.0) / calls, 1),
        "busy_fraction": round(
            delta.get(f'voxtriton_codec_busy_seconds_total{{lane="{lane}"}}', 0.0) / lane_seconds, 3
        ),
    }


class Fleet:
    """The servers of one measurement: one tritonserver (on GPU G with "POLICY@G"), or one per GPU
    ("POLICY*N"), which the load generator reaches least-loaded, as the gateway does."""

    def __init__(self, args, spec: str):
        self.allow_kernel_fallback = args.allow_kernel_fallback
        spec, _, pinned = spec.partition("@")
        self.policy, _, count = spec.partition("*")
        self.label = f"{self.policy} x{count} GPUs" if count else self.policy
        parameters = {
            "tts": {
                "max_streams": str(args.max_streams),
                "max_queued": str(args.max_queued),
                "max_draining": str(args.max_draining),
            }
        }
        for model, values in parse_params(args.param).items():
            parameters.setdefault(model, {}).update(values)
        gpus = range(int(count)) if count else [int(pinned) if pinned else None]
        self.servers = [
            TritonServer(
                checkpoint=args.checkpoint,
                policy=self.policy,
                parameters=parameters,
                tritonserver=args.tritonserver,
                gpu=gpu,
            )
            for gpu in gpus
        ]
        self.urls = [server.grpc_url for server in self.servers]

    def start(self) -> None:
        for server in self.servers:  # they come up together (graph capture takes a while)
            server.launch()
        for server in self.servers:
            server.wait_ready(300)
        fallbacks = [
            line
            for server in self.servers
            for line in kernel_fallbacks(server.log_file.read_text(errors="replace"))
        ]
        if fallbacks and not self.allow_kernel_fallback:
            raise SystemExit(
                f"{len(fallbacks)} GPU kernel check(s) failed, so the server runs the slower PyTorch "
                f"formulas and would measure that, not the build (pass --allow-kernel-fallback to "
                f"measure it anyway); the first: {fallbacks[0]}"
            )

    def metrics(self) -> dict[str, float]:
        """Counters summed over the servers."""
        total: dict[str, float] = {}
        for server in self.servers:
            for name, value in server.metrics().items():
                total[name] = total.get(name, 0.0) + value
        return total

    def stop(self, logs: Path | None) -> None:
        for index, server in enumerate(self.servers):
            server.stop()
            if logs and server.log_file.exists():
                logs.mkdir(parents=True, exist_ok=True)
                suffix = f"_gpu{index}" if len(self.servers) > 1 else ""
                shutil.copyfile(server.log_file, logs / f"server_{self.policy}{suffix}.log")
            server.cleanup()


# The opening of voxtriton.kernels' fallback warning, for any kernel on a GPU: "Triton kernel NAME
# unavailable on cuda..." (re.escape leaves its %s placeholders as they are).
KERNEL_FALLBACK = re.compile(re.escape(FALLBACK_WARNING.split(" (")[0]) % (r"\w+", "cuda"))


def kernel_fallbacks(server_log: str) -> list[str]:
    """The server log's lines saying a Triton kernel failed its check on a GPU (voxtriton.kernels).
    A device image exports CC, the C compiler Triton builds its launchers with; a call script that
    reused the name for its own argument made every kernel fall back, and the frame step took 58 ms
    instead of 20 (sessions 21 and 22, goodput_h200.md)."""
    return [line.strip() for line in server_log.splitlines() if KERNEL_FALLBACK.search(line)]


class GaugeSampler:
    """Reads the servers' gauges every `interval_s` while a probe runs, on a thread of its own (off
    the client's event loop): the streams generating (holding a KV-cache row), the requests
    waiting for a row and the streams draining (generated, audio still owed). A probe's means hide
    its steady state: in session 11 the batch averaged 263 over a probe at 82 req/s while its
    busiest 5 s windows held 464-477 streams (`max_streams` 512).
    A read parses the metrics page in Python, about a millisecond that the client's event loop may
    wait for the GIL; `client_loop_lag_*` would show it. With several servers the figures are sums
    over them, not per server."""

    def __init__(self, fleet: Fleet, interval_s: float = 0.5):
        self.fleet, self.interval_s = fleet, interval_s
        self.rows: list[float] = []
        self.waiting: list[float] = []
        self.draining: list[float] = []
        self.failed_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                metrics = self.fleet.metrics()
            except Exception:  # a server too busy to answer in time, a cut-off page: count it, go on
                self.failed_reads += 1
                continue
            self.rows.append(metrics.get("voxtriton_kv_rows_in_use", 0.0))
            self.waiting.append(metrics.get("voxtriton_waiting_requests", 0.0))
            self.draining.append(metrics.get("voxtriton_draining_streams", 0.0))

    def summary(self) -> dict:
        return {
            "samples": len(self.rows),
            "failed_reads": self.failed_reads,
            "rows_in_use_max": max(self.rows, default=None),
            "rows_in_use_p90": percentile(self.rows, 90),
            "waiting_for_row_max": max(self.waiting, default=None),
            "draining_max": max(self.draining, default=None),
        }


def measure(args, fleet: Fleet, label: str, run) -> dict:
    before = settled_metrics(fleet)  # the last probe's (or the warm-up's) updates applied, as `after`'s are
    # No garbage collection while a probe runs (cyclic garbage waits for the end of the probe). The
    # client's event loop stalled for 65-106 ms in 3 of 10 probes of session 6 (client_loop_lag_max_ms;
    # at most 13 ms in the others), which delays every chunk arriving meanwhile and can show as a stall
    # the server did not cause. A full collection over hundreds of streams' objects is the likeliest
    # cause: with collection off, no stall of the loop exceeded 28 ms in the 40 probes that followed.
    gc.collect()
    gc.disable()
    started = time.monotonic()
    try:
        with GaugeSampler(fleet) as gauges:
            results, lag = asyncio.run(run())
    finally:
        gc.enable()
    summary = summarize(results, lag)
    summary["server"] = server_side(
        before, settled_metrics(fleet), time.monotonic() - started, len(fleet.servers)
    )
    summary["server"]["gauges"] = gauges.summary()
    # Another busy process on the host slows the server's Python threads: session 5 lost three runs to
    # a neighbouring server computing on the CPUs. The 1-minute load average (which includes this
    # server and client, and overlaps the previous probe) makes that visible.
    summary["host_load_1min"], summary["host_cpus"] = (
        round(os.getloadavg()[0], 2),
        len(os.sched_getaffinity(0)),
    )
    print(
        f"{label}: "
        + json.dumps({k: v for k, v in summary.items() if k not in ("errors", "server", "timeline")}),
        flush=True,
    )
    if summary["errors"]:
        print(f"  errors: {summary['errors']}", flush=True)
    return summary


def settled_metrics(fleet: Fleet, timeout: float = 5.0) -> dict[str, float]:
    """The servers' metrics once their writers have applied everything queued (they apply updates
    every 0.1 s, see serving/triton_metrics.py): two reads 0.25 s apart that agree."""
    deadline = time.monotonic() + timeout
    previous = fleet.metrics()
    while True:
        time.sleep(0.25)
        current = fleet.metrics()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


def warm_up(args, fleet: Fleet) -> None:
    asyncio.run(open_loop(fleet.urls, 2.0 * len(fleet.urls), 2.0, 1.0, (1.0, 2.0), 999, args.speaker))


def open_loop_probe(
    args, fleet: Fleet, label: str, rate: float, duration: float, seed: int, progress: Progress | None = None
) -> dict:
    """One measured open-loop probe: arrivals at `rate` for `duration` seconds, with the run's burstiness,
    utterance lengths and speaker; `seed` picks the arrivals."""
    return measure(
        args,
        fleet,
        label,
        lambda: open_loop(
            fleet.urls,
            rate,
            duration,
            args.burstiness,
            (args.min_seconds, args.max_seconds),
            seed,
            args.speaker,
            progress,
        ),
    )


def warm_up_load(args, fleet: Fleet, policy: str) -> dict:
    """`--warm-up-load` seconds of arrivals at the lowest rate the run measures, not counted as a probe.
    On fresh device machines a server's first probe has collapsed without a cause found (sessions 10
    and 14: p90 TTFA of seconds where later, higher probes passed); this keeps that out of the results
    and records what the warm-up itself saw. Its arrivals (seed - 1) are none of the probes' (seed + repeat)."""
    rate = min(args.rates) if args.rates else args.rate_low
    summary = open_loop_probe(
        args, fleet, f"{policy} warm-up {rate:g}/s", rate, args.warm_up_load, args.seed - 1
    )
    return {"rate": rate, "seconds": args.warm_up_load, **summary}


class Termination:
    """SIGTERM as SystemExit (so `finally` blocks run), once, and held back while servers stop:
    raised inside `TritonServer.stop` it would skip the kill of the stubs' process group and the
    MPS daemon's quit. (`timeout` signals the process and then its group: a second SIGTERM is
    ignored.)"""

    def __init__(self):
        self.requested, self.deferring = False, 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested = True
        if not self.deferring:
            sys.exit(128 + signum)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
            if self.requested and not self.deferring:
                sys.exit(128 + signal.SIGTERM)


TERMINATION = Termination()


def run_policy(args, spec: str, probed: Callable[[dict], None] = lambda out: None) -> dict:
    """One policy's servers and probes. `probed(out)` gets the results so far after each probe."""
    fleet = Fleet(args, spec)
    policy = fleet.label
    out: dict = {"policy": policy, "rates": [], "concurrency": []}
    try:
        fleet.start()
        warm_up(args, fleet)
        if args.warm_up_load:
            out["warm_up"] = warm_up_load(args, fleet, policy)
        seconds = (args.min_seconds, args.max_seconds)
        for rate in args.rates:
            for repeat in range(args.repeats):
                label = f"{policy} {rate:g}/s" + (f" #{repeat + 1}" if args.repeats > 1 else "")
                progress = Progress(label, args.duration)
                summary = open_loop_probe(
                    args,
                    fleet,
                    f"{policy} rate {rate:g}/s",
                    rate,
                    args.duration,
                    args.seed + repeat,
                    progress,
                )
                progress.close()
                out["rates"].append({"rate": rate, "repeat": repeat, **summary})
                probed(out)
        for streams in args.concurrency:
            summary = measure(
                args,
                fleet,
                f"{policy} {streams} streams",
                lambda: closed_loop(fleet.urls, streams, args.duration, seconds, args.seed, args.speaker),
            )
            out["concurrency"].append({"streams": streams, **summary})
            probed(out)
        if args.goodput:

            def searching(trials: list[dict]) -> None:
                out["goodput"] = {"goodput": None, "trials": trials, "note": "search not finished"}
                probed(out)

            out["goodput"] = find_goodput(args, fleet, policy, searching)
    finally:
        with TERMINATION.deferred():  # a SIGTERM now would leave stubs and MPS daemons running
            fleet.stop(Path(args.out) if args.keep_logs else None)
    return out


def search_goodput(passes, low: float, high: float, steps: int) -> tuple[float, str | None]:
    """The highest rate that `passes(rate)`, by geometric bisection between `low` and `high` (rates
    span orders of magnitude). A failing `low` does not end the search: it moves down by the same
    ratio, up to `steps` times, so a bracket set too high still finds the goodput."""
    moved = False
    for _ in range(steps + 1):
        if passes(low):
            break
        low, high, moved = low * low / high, low, True
    else:
        return 0.0, "no probe passed; lower --rate-low"
    if not moved and passes(high):  # (once moved, `high` is a rate that failed)
        return high, "target met at --rate-high; raise it"
    for _ in range(steps):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if passes(middle) else (low, middle)
    return low, None


def find_goodput(
    args, fleet: Fleet, policy: str, searching: Callable[[list[dict]], None] = lambda trials: None
) -> dict:
    """The highest rate meeting p90 TTFA <= 200 ms with no stall (`search_goodput`); every probe is
    kept, and `searching(trials)` gets them after each one."""
    trials = []

    def probe(rate, repeat):
        summary = open_loop_probe(
            args, fleet, f"{policy} goodput probe {rate:.2f}/s", rate, args.duration, args.seed + repeat
        )
        trials.append({"rate": rate, "repeat": repeat, "meets": meets_target(summary), **summary})
        searching(trials)
        return trials[-1]["meets"]

    def trial(rate):  # passes when every repeat does (`all` stops at the first that fails)
        return all(probe(rate, repeat) for repeat in range(args.repeats))

    rate, note = search_goodput(trial, args.rate_low, args.rate_high, args.bisection_steps)
    return {"goodput": rate, "trials": trials, **({"note": note} if note else {})}


def write_outputs(args, results: list[dict], meta: dict, echo: bool = True) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / "results.json", json.dumps({"meta": meta, "policies": results}, indent=2))
    lines = [
        f"# Serving benchmark ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Hardware: {meta['hardware']}. Checkpoint: {meta['checkpoint']} (random weights: timings are real, "
        "audio is noise).",
        "",
    ]
    if any(r["rates"] for r in results):
        lines += [
            "| policy | rate/s | done | failed | TTFA p50 ms | p90 | p99 | stalled | stall s | RTF | frame step ms | "
            "admit ms per request (GPU) | urgent share (promoted) | lanes busy (chunks/call) | rows max (waiting max) | "
            "host load (CPUs) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            for row in r["rates"]:
                s = row["server"]
                lines.append(
                    f"| {r['policy']} | {row['rate']:g} | {row['completed']} | {row['failed']} | {row['ttfa_p50_ms']} | "
                    f"{row['ttfa_p90_ms']} | {row['ttfa_p99_ms']} | {row['stalled_requests']} | "
                    f"{row['stall_total_s']:.2f} | {_fmt(row['rtf_median'])} | {s['frame_step_ms_mean']} | "
                    f"{_fmt(s.get('admit_ms_per_request'))} ({_fmt(s.get('prefill_device_ms_per_request'))}) | "
                    f"{_fmt(s['urgent_share'])} ({_count(s.get('promoted_chunks'))}) | {lane_occupancy(s)} | "
                    f"{row_peaks(s)} | "
                    f"{row['host_load_1min']} ({row['host_cpus']}) |"
                )
        lines.append("")
    if any(r["concurrency"] for r in results):
        lines += [
            "| policy | streams | done | TTFA p90 ms | stalled | frame step ms (mean batch) | urgent codec ms | "
            "background codec ms | first-chunk codec ms | urgent share |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            for row in r["concurrency"]:
                s = row["server"]
                lines.append(
                    f"| {r['policy']} | {row['streams']} | {row['completed']} | {row['ttfa_p90_ms']} | "
                    f"{row['stalled_requests']} | {s['frame_step_ms_mean']} ({_fmt(s['frame_step_batch_mean'])}) | "
                    f"{s['codec_ms_mean']['urgent']} | {s['codec_ms_mean']['background']} | "
                    f"{s['first_chunk_codec_ms_mean']} | {_fmt(s['urgent_share'])} |"
                )
        lines.append("")
    goodputs = {
        r["policy"]: r["goodput"]["goodput"]
        for r in results
        if r.get("goodput", {}).get("goodput") is not None
    }
    if goodputs:
        lines += ["| policy | goodput (req/s) | peak listeners at that rate |", "|---|---|---|"]
        for r in results:
            if r["policy"] in goodputs:
                passing = [
                    t for t in r["goodput"]["trials"] if t["meets"] and t["rate"] == r["goodput"]["goodput"]
                ]
                peak = passing[0].get("listeners_peak", "-") if passing else "-"
                lines.append(f"| {r['policy']} | {r['goodput']['goodput']:.2f} | {peak} |")
        baselines = [g for p, g in goodputs.items() if p != "voxserve"]
        if "voxserve" in goodputs and baselines and max(baselines) > 0:
            lines += ["", f"voxserve / best baseline = {goodputs['voxserve'] / max(baselines):.2f}x"]
        lines.append("")
    write_whole(out / "results.md", "\n".join(lines) + "\n")
    plot(results, out)
    if echo:
        print("\n".join(lines))


def write_whole(path: Path, text: str) -> None:
    """Replace `path` at once, so a run stopped mid-write leaves the previous version, not half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def row_peaks(server: dict) -> str:
    """ "471 (12)": the most streams generating at once in the probe's samples, and the most waiting
    for a row; "-" for results from before the sampler."""
    gauges = server.get("gauges") or {}
    if gauges.get("rows_in_use_max") is None:
        return "-"
    return f"{gauges['rows_in_use_max']:g} ({gauges['waiting_for_row_max']:g})"


def lane_occupancy(server: dict) -> str:
    """ "urgent 0.41 (3.2), background 0.97 (11.8)": each lane's busy share and chunks per call."""
    lanes = server.get("codec_lanes", {})
    return (
        ", ".join(f"{lane} {v['busy_fraction']:.2f} ({v['chunks_per_call']:g})" for lane, v in lanes.items())
        or "-"
    )


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _count(value) -> str:  # "-": results from before the metric
    return "-" if value is None else f"{value:g}"


def plot(results: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return

    def by_rate(r):  # open-loop rates, else the goodput search's probes
        return sorted(r["rates"] or r.get("goodput", {}).get("trials", []), key=lambda row: row["rate"])

    if any(by_rate(r) for r in results):
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for r in results:
            rows = by_rate(r)
            answered = [
                row for row in rows if row["ttfa_p90_ms"] is not None
            ]  # (no TTFA: every request failed)
            left.plot(
                [row["rate"] for row in answered],
                [row["ttfa_p90_ms"] for row in answered],
                marker="o",
                label=r["policy"],
            )
            right.plot(
                [row["rate"] for row in rows],
                [row["stalled_fraction"] or 0 for row in rows],
                marker="o",
                label=r["policy"],
            )
        left.axhline(TTFA_TARGET_S * 1e3, color="grey", linestyle="--", linewidth=1)
        left.set(
            xlabel="arrival rate (requests/s)",
            ylabel="p90 TTFA (ms)",
            xscale="log",
            yscale="log",
            title="Time to first audio",
        )
        right.set(
            xlabel="arrival rate (requests/s)",
            ylabel="stalled fraction",
            xscale="log",
            title="Requests that stalled",
        )
        left.legend()
        figure.tight_layout()
        figure.savefig(out / "ttfa_stalls_vs_rate.png", dpi=120)
        plt.close(figure)
    if any(r["concurrency"] for r in results):
        figure, axis = plt.subplots(figsize=(6, 4))
        for r in results:
            axis.plot(
                [row["streams"] for row in r["concurrency"]],
                [row["server"]["frame_step_ms_mean"] for row in r["concurrency"]],
                marker="o",
                label=r["policy"],
            )
        axis.set(
            xlabel="concurrent streams",
            ylabel="backbone frame step (ms)",
            xscale="log",
            title="Backbone step under load",
        )
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / "frame_step_vs_streams.png", dpi=120)
        plt.close(figure)


def hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    except ImportError:
        pass
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint")
    parser.add_argument(
        "--policies",
        default="voxserve,concurrent,serial",
        help="comma-separated; POLICY*N: N servers, one per GPU, behind least-loaded routing; "
        "POLICY@G: one server pinned to GPU G",
    )
    parser.add_argument("--rates", default="", help="comma-separated arrival rates (requests/s)")
    parser.add_argument("--concurrency", default="", help="comma-separated closed-loop stream counts")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per measurement")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="coefficient of variation of gaps (1 = Poisson)"
    )
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument(
        "--warm-up-load",
        type=float,
        default=0.0,
        help="seconds of arrivals at the lowest rate before "
        "the first probe, not counted (0: only a light 2 s warm-up)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="probes per rate, each with its own arrivals (seed, "
        "seed + 1, ...); in a goodput search a rate passes only if every probe does. Near a "
        "policy's limit one probe can pass and the next fail",
    )
    parser.add_argument("--goodput", action="store_true")
    parser.add_argument("--rate-low", type=float, default=1.0)
    parser.add_argument("--rate-high", type=float, default=64.0)
    parser.add_argument("--bisection-steps", type=int, default=4)
    parser.add_argument("--max-streams", type=int, default=256)
    parser.add_argument("--max-queued", type=int, default=1024)
    parser.add_argument(
        "--max-draining",
        type=int,
        default=768,
        help="codec state rows added for streams generated but still owed audio (about 5 MB "
        "each with Qwen3-TTS's codec); voxserve held about 315 or more at 116 req/s (1.7B, H200)",
    )
    parser.add_argument("--speaker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="MODEL:KEY=VALUE config.pbtxt parameter")
    parser.add_argument("--tritonserver", help="tritonserver binary (default: as `voxtriton serve` finds it)")
    parser.add_argument("--keep-logs", action="store_true", help="copy each server's log into --out")
    parser.add_argument(
        "--allow-kernel-fallback",
        action="store_true",
        help="measure a GPU server whose Triton kernels failed their checks (by default the run stops)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run on the tiny checkpoint (< 60 s)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--replot", action="store_true", help="only redraw the plots of --out/results.json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((Path(args.out) / "results.json").read_text())["policies"], Path(args.out))
        return
    if args.smoke:
        import tempfile

        from voxtriton.models.random_checkpoint import make_checkpoint

        args.checkpoint = args.checkpoint or str(make_checkpoint("tiny", Path(tempfile.mkdtemp()) / "tiny"))
        args.policies, args.rates = (
            args.policies if args.policies != "voxserve,concurrent,serial" else "voxserve",
            "1",
        )
        args.duration, args.min_seconds, args.max_seconds, args.max_streams = 6.0, 1.0, 2.0, 16
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    if not args.checkpoint:
        parser.error("--checkpoint is required (or --smoke)")
    meta = {
        "command": " ".join(sys.argv),
        "hardware": hardware(),
        "checkpoint": args.checkpoint,
        "date": time.strftime("%Y-%m-%d"),
        "duration_s": args.duration,
        "burstiness": args.burstiness,
        "utterance_seconds": [args.min_seconds, args.max_seconds],
        "ttfa_target_ms": TTFA_TARGET_S * 1e3,
    }
    # A run cut short (`timeout` sends SIGTERM) still stops its servers, MPS daemons and Python stubs
    # (run_policy's `finally`), which would otherwise hold the GPU beside the next run's server, and
    # keeps every probe it finished: the outputs are rewritten after each one.
    TERMINATION.install()
    results: list[dict] = []
    for policy in args.policies.split(","):

        def probed(partial: dict, finished: list[dict] = list(results)) -> None:
            write_outputs(args, finished + [partial], meta, echo=False)

        results.append(run_policy(args, policy, probed))
        write_outputs(args, results, meta)


if __name__ == "__main__":
    main()
