"""The listener's experience under load: Poisson arrivals over gRPC streaming per policy, or over
HTTP to any OpenAI-compatible streaming speech endpoint.

    # open loop: Poisson arrivals at each rate for --duration seconds, every policy, one server each
    python benchmarks/serving_bench.py --checkpoint DIR --policies voxserve,concurrent,serial \
        --rates 2,4,8 --out results/x
    # goodput by bisection, by both definitions (strict: p90 TTFA <= 200 ms and no stalled request;
    # SLO attainment: at least 99% of requests start within 200 ms and never stall)
    python benchmarks/serving_bench.py --checkpoint DIR --goodput --rate-low 1 --rate-high 64 --out results/x
    # another server, already running (the harness starts nothing): the same workload over HTTP
    python benchmarks/serving_bench.py --target openai --url http://HOST:PORT --model NAME --voice ryan \
        --length-field max_new_tokens --extra-body '{"task_type": "CustomVoice"}' --rates 2,4 --out results/y
    # scaling: goodput of one GPU alone, then of 8 (one server each) behind Envoy, rates per server,
    # the load from 8 client processes; results.md gives the fleet's goodput per GPU against linear
    python benchmarks/serving_bench.py --checkpoint DIR --policies 'voxserve@0,voxserve*8' --goodput \
        --rates-per-server --rate-low 90 --rate-high 130 --proxy envoy --client-processes 8 --out results/s
    # closed loop: N concurrent streams at all times (lane behaviour at 8, 32, 128 streams)
    python benchmarks/serving_bench.py --checkpoint DIR --concurrency 8,32,128 --out results/x
    # CPU smoke test (tiny random checkpoint, under a minute): what the test suite runs
    python benchmarks/serving_bench.py --smoke --out /tmp/smoke
    # a Base checkpoint: voices registered in DIR, half the requests in-context, half x-vector only
    python benchmarks/serving_bench.py --checkpoint BASE --param tts:voices_dir=DIR --voice xvec \
        --voice-mix icl:0.5 --rates 8,16 --out results/z

Workload: utterances of U(3, 20) seconds of audio (max_frames at 12.5 frames/s with ignore_eos, so
random weights behave like real ones; over HTTP the frames go in --length-field), texts drawn from
TEXTS, arrival gaps from a Gamma distribution with mean 1/rate and shape 1/burstiness**2
(burstiness 1 = Poisson).

Metrics (client side): TTFA = request sent to first audio received; stall =
simulated playback that starts at the first chunk; RTF = generation time / audio duration. The
client measures its own event-loop lag, so it can show it was not the bottleneck. Server-side
numbers (frame step time, lane latencies, share of urgent chunks) come from the metrics endpoint;
for --target openai there are none (reported as null). Over HTTP, audio is counted as its bytes
arrive (16-bit mono PCM at 24 kHz). Checkpoints are random-weight: timings are real, audio is noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from voxtriton.bench.fleet import TERMINATION, Fleet, GaugeSampler, hardware, settled_metrics
from voxtriton.bench.goodput import same_rate, search_goodput
from voxtriton.bench.proxy import envoy_binary, proxy_use
from voxtriton.bench.server_metrics import server_side
from voxtriton.bench.summary import TTFA_TARGET_S, summarize, verdicts
from voxtriton.bench.targets import GATEWAY_EXTRA_BODY, Endpoint, parse_extra_body
from voxtriton.bench.workload import (
    Progress,
    VoiceMix,
    client_processes,
    closed_loop,
    one_request,
    open_loop,
    sharded_open_loop,
    without_gc,
)
from voxtriton.kernels.registry import KERNELS_OFF_VARIABLE

# Goodput definition -> the key of a probe's verdict on it (summary.verdicts)
RULES = {"strict": "meets", "attainment": "attains"}
UNREAD = "- | - | - | - | -"  # the server-side cells of a table row, for a system whose metrics are not read


def measure(args, fleet: Fleet | Endpoint, label: str, run) -> dict:
    """One probe, with the servers' side of it; None there for a system whose servers the harness
    cannot read (an Endpoint)."""
    metered = bool(fleet.servers)
    before = settled_metrics(fleet) if metered else None  # the last probe's updates applied, as `after`'s are
    proxy_before = fleet.proxy_sample()
    with without_gc():
        started = time.monotonic()
        with GaugeSampler(fleet) if metered else contextlib.nullcontext() as gauges:
            results, lag = asyncio.run(run())
    summary = summarize(results, lag)
    summary["server"] = None
    if metered:
        summary["server"] = server_side(
            before, settled_metrics(fleet), time.monotonic() - started, len(fleet.servers)
        )
        summary["server"]["gauges"] = gauges.summary()
    summary["proxy"] = proxy_use(proxy_before, fleet.proxy_sample(), time.monotonic() - started)
    # Another busy process on the host slows the server's Python threads; the 1-minute load average
    # (this server and client included, overlapping the previous probe) makes that visible.
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


def check_serves(args, fleet: Fleet | Endpoint) -> None:
    """One short request before anything is measured: a system that does not serve it ends the run
    with the reason, rather than measuring a probe of failures."""

    async def one():
        target = fleet.make_target()
        try:
            return await one_request(target, random.Random(args.seed), (1.0, 1.0), args.speaker)
        finally:
            await target.close()

    result = asyncio.run(one())
    if result.error or not result.audio_s:
        where = f" at {fleet.url}" if isinstance(fleet, Endpoint) else ""
        raise SystemExit(
            f"{fleet.label}{where} did not serve a test request, so nothing is measured: "
            f"{result.error or 'it returned no audio'}"
        )


def warm_up(args, fleet: Fleet | Endpoint) -> None:
    """2 s of light load, not measured: from every client process (their connections, tokenizers)."""
    rate = 2.0 * width(fleet)
    asyncio.run(load_from_clients(args, fleet.make_target, rate, 2.0, 1.0, (1.0, 2.0), 999))


def open_loop_probe(
    args,
    fleet: Fleet | Endpoint,
    label: str,
    rate: float,
    duration: float,
    seed: int,
    progress: Progress | None = None,
) -> dict:
    """One measured open-loop probe: arrivals at `rate` for `duration` seconds, with the run's burstiness,
    utterance lengths and speaker; `seed` picks the arrivals."""
    load = (fleet.make_target, rate, duration, args.burstiness, (args.min_seconds, args.max_seconds), seed)
    return measure(args, fleet, label, lambda: load_from_clients(args, *load, progress=progress))


def load_from_clients(args, make_target, rate, duration, burstiness, seconds_range, seed, progress=None):
    """The open loop with the run's speaker, from the harness's process or its --client-processes
    (where a progress bar has no arrivals to show)."""
    load = (make_target, rate, duration, burstiness, seconds_range, seed, args.speaker)
    if args.client_pool is None:
        return open_loop(*load, progress)
    return sharded_open_loop(args.client_pool, args.client_processes, *load)


def warm_up_load(args, fleet: Fleet | Endpoint, policy: str) -> dict:
    """`--warm-up-load` seconds of arrivals at the lowest rate the run measures, not counted as a probe,
    for a fresh server whose first load may behave unlike later ones; what the warm-up saw is recorded.
    Its arrivals (seed - 1) are none of the probes' (seed + repeat)."""
    rate = (min(args.rates) if args.rates else args.rate_low) * rate_scale(args, fleet)
    summary = open_loop_probe(
        args, fleet, f"{policy} warm-up {rate:g}/s", rate, args.warm_up_load, args.seed - 1
    )
    return {"rate": rate, "seconds": args.warm_up_load, **summary}


def run_policy(args, spec: str, probed: Callable[[dict], None] = lambda out: None) -> dict:
    """One policy's servers (or the --target openai endpoint) and probes. `probed(out)` gets the
    results so far after each probe."""
    fleet = endpoint(args) if args.target == "openai" else Fleet(args, spec)
    policy = fleet.label
    out: dict = {
        "policy": policy,
        "target": args.target,
        "servers": len(fleet.servers),
        "gpus": fleet.gpus,
        "proxy": fleet.proxy_ports is not None,
        "rates": [],
        "concurrency": [],
    }
    try:
        fleet.start()
        check_serves(args, fleet)
        warm_up(args, fleet)
        if args.warm_up_load:
            out["warm_up"] = warm_up_load(args, fleet, policy)
        seconds = (args.min_seconds, args.max_seconds)
        for rate in (rate * rate_scale(args, fleet) for rate in args.rates):
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
                lambda: closed_loop(
                    fleet.make_target, streams, args.duration, seconds, args.seed, args.speaker
                ),
            )
            out["concurrency"].append({"streams": streams, **summary})
            probed(out)
        if args.goodput:

            def searching(trials: list[dict]) -> None:
                out["goodput"] = {"trials": trials, "note": "search not finished"}
                probed(out)

            out["goodput"] = find_goodput(args, fleet, policy, searching)
    finally:
        with TERMINATION.deferred():  # a SIGTERM now would leave stubs and MPS daemons running
            fleet.stop(Path(args.out) if args.keep_logs else None)
    return out


def width(fleet: Fleet | Endpoint) -> int:
    """How many share the load: the servers the harness started, else the endpoint's GPUs (if known)."""
    return max(1, len(fleet.servers) or fleet.gpus)


def rate_scale(args, fleet: Fleet | Endpoint) -> int:
    """--rates-per-server: the rates asked for are each server's, so N servers are probed at N times them."""
    return width(fleet) if args.rates_per_server else 1


def endpoint(args) -> Endpoint:
    label = (args.label or "openai") + (f" on {args.gpus} GPUs" if args.gpus > 1 else "")
    return Endpoint(
        args.url, args.model, args.extra_body, args.length_field, args.seed_field, label, args.gpus
    )


def find_goodput(
    args,
    fleet: Fleet | Endpoint,
    policy: str,
    searching: Callable[[list[dict]], None] = lambda trials: None,
) -> dict:
    """The highest rate passing each of --goodput-rules (`search_goodput`), one search after the
    other; a probe at a rate and repeat already measured is reused, not run again. Every probe is
    kept with both verdicts, and `searching(trials)` gets them after each one."""
    trials: list[dict] = []

    def probe(rate, repeat) -> dict:
        for done in trials:
            if done["repeat"] == repeat and same_rate(done["rate"], rate):
                return done
        summary = open_loop_probe(
            args, fleet, f"{policy} goodput probe {rate:.2f}/s", rate, args.duration, args.seed + repeat
        )
        trials.append({"rate": rate, "repeat": repeat, **verdicts(summary), **summary})
        searching(trials)
        return trials[-1]

    found: dict = {"trials": trials}
    for rule in args.goodput_rules:

        def trial(rate):  # passes when every repeat does (`all` stops at the first that fails)
            return all(probe(rate, repeat)[RULES[rule]] for repeat in range(args.repeats))

        low, high = (bound * rate_scale(args, fleet) for bound in (args.rate_low, args.rate_high))
        rate, note = search_goodput(trial, low, high, args.bisection_steps)
        found[rule] = {"goodput": rate, **({"note": note} if note else {})}
    return found


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
    if meta.get("voice_mix"):
        lines += [f"Voices: `{meta['voice_mix']}` (VOICE:SHARE per request), the rest {meta['voice']}.", ""]
    if meta.get("text_rate"):
        rows = [row for r in results for row in r["rates"] + r.get("concurrency", [])]
        streamed = [f"{row['text_end_to_audio_end_p90_ms']}" for row in rows]
        waited = [_fmt((row.get("server") or {}).get("text_to_first_audio_ms_mean")) for row in rows]
        lines += [
            f"Input streaming: each text arrives as words at {meta['text_rate']:g}/s"
            + (
                f", each length is its text's ids plus {meta['text_tail_frames']} frames"
                if meta.get("text_tail_frames") is not None
                else ""
            )
            + "; TTFA counts from the "
            f"first word. Last word to last audio, p90 ms per row: {', '.join(streamed) or '-'}. First "
            "audio after the latest words the engine had taken for the first chunk (server side, mean "
            f"ms per row): {', '.join(waited) or '-'}.",
            "",
        ]
    if any(r["rates"] for r in results):
        lines += [
            "| policy | rate/s | done | failed | TTFA p50 ms | p90 | p99 | stalled | stall s | "
            "SLO attained | RTF | frame step ms | admit ms per request (GPU) | urgent share (promoted) | "
            "lanes busy (chunks/call) | rows max (waiting max) | host load (CPUs) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            for row in r["rates"]:
                lines.append(
                    f"| {r['policy']} | {row['rate']:g} | {row['completed']} | {row['failed']} | "
                    f"{row['ttfa_p50_ms']} | {row['ttfa_p90_ms']} | {row['ttfa_p99_ms']} | "
                    f"{row['stalled_requests']} | {row['stall_total_s']:.2f} | "
                    f"{_share(row.get('slo_attainment'))} | {_fmt(row['rtf_median'])} | "
                    f"{server_cells(row['server'])} | "
                    f"{row['host_load_1min']} ({row['host_cpus']}) |"
                )
        lines.append("")
    if any(r["concurrency"] for r in results):
        lines += [
            "| policy | streams | done | TTFA p90 ms | stalled | frame step ms (mean batch) | "
            "urgent codec ms | background codec ms | first-chunk codec ms | urgent share |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            for row in r["concurrency"]:
                s = row["server"]
                server = (
                    f"{s['frame_step_ms_mean']} ({_fmt(s['frame_step_batch_mean'])}) | "
                    f"{s['codec_ms_mean']['urgent']} | {s['codec_ms_mean']['background']} | "
                    f"{s['first_chunk_codec_ms_mean']} | {_fmt(s['urgent_share'])}"
                    if s
                    else UNREAD
                )
                lines.append(
                    f"| {r['policy']} | {row['streams']} | {row['completed']} | {row['ttfa_p90_ms']} | "
                    f"{row['stalled_requests']} | {server} |"
                )
        lines.append("")
    searched = [r for r in results if any(rule in r.get("goodput", {}) for rule in RULES)]
    if searched:
        lines += goodput_table(searched)
    lines += load_path(results, meta)
    write_whole(out / "results.md", "\n".join(lines) + "\n")
    plot(results, out)
    if echo:
        print("\n".join(lines))


def load_path(results: list[dict], meta: dict) -> list[str]:
    """What stood between the client and the servers in each open-loop probe (fixed rates, then the
    goodput searches'), where the run had more than the harness's one process: the client's
    event-loop lag, and Envoy's CPU and balance."""
    if meta.get("client_processes", 1) == 1 and not meta.get("proxy"):
        return []
    probes = []
    for r in results:
        for row in r["rates"] + r.get("goodput", {}).get("trials", []):
            proxy = row.get("proxy")
            through = (
                f", Envoy {proxy['cpu_cores']} cores (busiest thread {proxy['busiest_thread']}), "
                "streams per server "
                f"{'/'.join(map(str, proxy['streams_per_server']))}"
                if proxy
                else ""
            )
            probes.append(f"{r['policy']} {row['rate']:g}/s: lag {row['client_loop_lag_p99_ms']}{through}")
    return [
        f"Load path: {meta.get('client_processes', 1)} client process(es)"
        + (f", Envoy ({meta['proxy_threads']} worker threads) in front" if meta.get("proxy") else "")
        + "; per probe, the client's event-loop lag p99 ms over all its processes"
        + (" and what Envoy used" if meta.get("proxy") else "")
        + ": "
        + "; ".join(probes)
        + ".",
        "",
    ]


def write_whole(path: Path, text: str) -> None:
    """Replace `path` at once, so a run stopped mid-write leaves the previous version, not half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def goodput_table(results: list[dict]) -> list[str]:
    """Each policy's goodput by both definitions, with how many of the probes at that rate passed."""
    lines = [
        "| policy | strict goodput (req/s) | probes passed at it | SLO-attainment goodput (req/s) | "
        "probes passed at it | peak listeners at the strict goodput | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    best = {}
    for r in results:
        cells, notes, listeners = [], [], None
        for rule, verdict in RULES.items():
            found = r["goodput"].get(rule)
            if found is None:
                cells += ["-", "-"]
                continue
            best[rule, r["policy"]] = found["goodput"]
            at = [t for t in r["goodput"]["trials"] if same_rate(t["rate"], found["goodput"])]
            cells += [f"{found['goodput']:.2f}", f"{sum(bool(t[verdict]) for t in at)} of {len(at)}"]
            notes += [f"{rule}: {found['note']}"] if "note" in found else []
            if rule == "strict":
                listeners = max((t["listeners_peak"] for t in at if t[verdict]), default=None)
        lines.append(f"| {r['policy']} | {' | '.join(cells)} | {_count(listeners)} | {'; '.join(notes)} |")
    lines += scaling(results)
    # fleets (several GPUs, or behind the proxy) are compared by `scaling`, not as baselines
    fleets = {r["policy"] for r in results if r.get("gpus", 0) > 1 or r.get("proxy")}
    for rule in RULES:
        ours = best.get((rule, "voxserve"))
        baselines = [
            g for (kind, policy), g in best.items() if kind == rule and policy not in fleets | {"voxserve"}
        ]
        if ours is not None and baselines and max(baselines) > 0:
            lines += ["", f"{rule}: voxserve / best baseline = {ours / max(baselines):.2f}x"]
    return lines + [""]


def scaling(results: list[dict]) -> list[str]:
    """Each result on several GPUs (a fleet of servers, or one server whose codec models have a GPU
    of their own) against one GPU alone, reached directly, in the same run: the same policy's server,
    else voxserve's. Its goodput per GPU, as a fraction of linear scaling, by each definition. A search
    that ended at a bound of its range found a bound, not a goodput: then no ratio; with no result on
    one GPU in the run (an endpoint measured alone), per GPU only."""
    lines = []
    for rule in RULES:
        alone = {
            r["policy"]: r["goodput"].get(rule)
            for r in results
            if r.get("gpus", 0) == 1 and not r.get("proxy")
        }
        for r in results:
            found, gpus = r["goodput"].get(rule), r.get("gpus", 0)
            reference = re.split(r" (?:x\d+|on \d+) GPUs", r["policy"])[0]
            reference = reference if reference in alone else "voxserve"
            base = alone.get(reference)
            if gpus < 2 or not found:
                continue
            per_gpu = f"{rule}: {r['policy']}: {found['goodput'] / gpus:.2f} req/s per GPU"
            if not base:
                lines.append(f"{per_gpu} (no result on one GPU in this run)")
                continue
            notes = [
                f"{whose} search: {side['note']}"
                for whose, side in ((f"the {gpus} GPUs'", found), ("one GPU's", base))
                if "note" in side
            ]
            ratio = (
                f"no ratio ({'; '.join(notes)})"
                if notes
                else f"{found['goodput'] / (gpus * base['goodput']):.2f}x linear"
            )
            lines.append(f"{per_gpu}, {ratio} ({reference} on one GPU: {base['goodput']:.2f})")
    return [""] + lines if lines else []


def server_cells(server: dict | None) -> str:
    """The rates table's server-side cells; "-" each for a system whose metrics the harness cannot read."""
    if server is None:
        return UNREAD
    return (
        f"{server['frame_step_ms_mean']} | {_fmt(server.get('admit_ms_per_request'))} "
        f"({_fmt(server.get('prefill_device_ms_per_request'))}) | "
        f"{_fmt(server['urgent_share'])} ({_count(server.get('promoted_chunks'))}) | "
        f"{lane_occupancy(server)} | {row_peaks(server)}"
    )


def _share(fraction: float | None) -> str:  # "-": no requests, or results from before the metric
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


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
    # The frame step is a server-side figure: a peer behind --target openai reports none.
    stepped = [r for r in results if r["concurrency"] and all(row["server"] for row in r["concurrency"])]
    if stepped:
        figure, axis = plt.subplots(figsize=(6, 4))
        for r in stepped:
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target",
        choices=("triton", "openai"),
        default="triton",
        help="triton: start voxtriton's tritonservers (--policies) and measure them over gRPC; openai: "
        "measure the OpenAI-compatible speech endpoint at --url, which must already be running",
    )
    parser.add_argument("--url", help="--target openai: the server's base URL, e.g. http://127.0.0.1:8091")
    parser.add_argument("--model", help="--target openai: the request's model field")
    parser.add_argument(
        "--extra-body",
        default=json.dumps(GATEWAY_EXTRA_BODY),
        help="--target openai: a JSON object merged into every request, for the server's own fields "
        "(default: voxtriton's gateway's {\"ignore_eos\": true}, so random weights run to their length)",
    )
    parser.add_argument(
        "--length-field",
        default="max_frames",
        help="--target openai: the request field that fixes its length, in codec frames at 12.5 Hz "
        "(voxtriton's gateway: max_frames; vLLM-Omni: max_new_tokens)",
    )
    parser.add_argument(
        "--seed-field",
        default="seed",
        help="--target openai: the request field for its sampling seed ('' sends none)",
    )
    parser.add_argument("--label", help="--target openai: the system's name in the results (default openai)")
    parser.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="--target openai: the GPUs the endpoint computes on (default: not known); on several, its "
        "goodput is also given per GPU, and --rates-per-server takes each rate per GPU",
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
    parser.add_argument(
        "--goodput-rules",
        default="strict,attainment",
        help="the goodput definitions to search for, one bisection each (probes reused between them): "
        "strict (p90 TTFA <= 200 ms, no stalled or failed request) and attainment (at least 99%% of "
        "requests start within 200 ms and never stall); every probe records both verdicts",
    )
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
        "each with Qwen3-TTS's codec); near a policy's goodput hundreds of streams drain at once",
    )
    parser.add_argument(
        "--text-rate",
        type=float,
        default=0.0,
        help="input streaming: each text arrives as words at this many per second (an LLM's tokens, "
        "about a word each; TTFA counts from the first); 0: the whole text at once",
    )
    parser.add_argument(
        "--text-tail-frames",
        type=int,
        help="with --text-rate: each request's length is its text's ids (the interleaved layout takes "
        "one a frame) plus this many frames, instead of U(--min-seconds, --max-seconds): speech that "
        "ends this many frames after its text, so the last word to the last audio is what the server "
        "adds (a random-weight model does not end an utterance where its text does)",
    )
    parser.add_argument(
        "--proxy",
        choices=["envoy"],
        help="the load goes through Envoy, configured as deploy/envoy/ configures it (least request, "
        "health checks), to the servers of each POLICY*N; without it the harness routes least-loaded",
    )
    parser.add_argument("--proxy-threads", type=int, default=2, help="--proxy envoy: Envoy's worker threads")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="open-loop probes come from this many client processes, each with its share of the rate "
        "and arrivals of its own: the streams of several GPUs outrun one Python event loop (with "
        "--burstiness above 1 the merged arrivals are less bursty than one process's)",
    )
    parser.add_argument(
        "--rates-per-server",
        action="store_true",
        help="--rates, --rate-low and --rate-high are per server: POLICY*N is probed at N times them, "
        "an endpoint on --gpus N too (a scaling run: one server and N, one command, one search range)",
    )
    parser.add_argument("--speaker", "--voice", help="the voice (the request's speaker)")
    parser.add_argument(
        "--voice-mix",
        default="",
        help="VOICE:SHARE,...: that share of requests (drawn per request) names VOICE, e.g. a registered "
        "voice (Base checkpoints: --param tts:voices_dir=DIR); the rest --voice",
    )
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
    if args.text_rate < 0 or (args.text_rate and args.target == "openai"):
        parser.error("--text-rate: a rate above 0, for --target triton (input streaming is voxtriton's)")
    if args.text_tail_frames is not None and (not args.text_rate or args.text_tail_frames < 0):
        parser.error("--text-tail-frames: 0 or more frames, with --text-rate")
    if args.smoke and args.target == "openai":
        parser.error("--smoke starts a server: it is for --target triton")
    if args.smoke:
        from voxtriton.serving.runtime import ensure_checkpoint

        # the default tiny checkpoint `voxtriton serve` makes and caches, made now if it is not yet
        args.checkpoint = str(ensure_checkpoint(args.checkpoint or ""))
        args.policies, args.rates = (
            args.policies if args.policies != "voxserve,concurrent,serial" else "voxserve",
            "1",
        )
        args.duration, args.min_seconds, args.max_seconds, args.max_streams = 6.0, 1.0, 2.0, 16
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.client_processes < 1 or args.proxy_threads < 1:
        parser.error("--client-processes and --proxy-threads must be at least 1")
    if args.proxy and args.target == "openai":
        parser.error("--proxy puts Envoy in front of the servers the harness starts: for --target triton")
    if args.gpus < 0 or (args.gpus and args.target != "openai"):
        parser.error(
            f"--gpus: an endpoint's GPU count (--target openai), at least 0, got {args.gpus}; "
            "voxtriton's servers count theirs (POLICY*N for N GPUs)"
        )
    if args.proxy:
        try:
            envoy_binary()  # now, not after the searches that run without it
        except RuntimeError as error:
            parser.error(f"--proxy envoy: {error}")
    args.rates = [float(x) for x in args.rates.split(",") if x]
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.goodput_rules = [rule for rule in args.goodput_rules.split(",") if rule]
    unknown = [rule for rule in args.goodput_rules if rule not in RULES]
    if unknown or not args.goodput_rules:
        parser.error(f"--goodput-rules: {','.join(unknown) or 'none given'}; choose from {', '.join(RULES)}")
    if args.voice_mix:
        try:
            args.speaker = VoiceMix.parse(args.speaker, args.voice_mix)
        except ValueError as error:
            parser.error(str(error))
    if args.target == "openai":
        missing = [option for option in ("url", "model") if not getattr(args, option)]
        if missing:
            parser.error(f"--target openai needs {' and '.join('--' + m for m in missing)}")
        try:
            args.extra_body = parse_extra_body(args.extra_body)
        except ValueError as error:
            parser.error(str(error))
        args.policies = args.label or "openai"  # one system, the endpoint
    elif not args.checkpoint:
        parser.error("--checkpoint is required (or --smoke)")
    # The servers this run starts inherit the environment: a kernel turned off is part of the command.
    kernels_off = os.environ.get(KERNELS_OFF_VARIABLE, "")
    meta = {
        "command": (f"{KERNELS_OFF_VARIABLE}={kernels_off} " if kernels_off else "") + " ".join(sys.argv),
        # An endpoint's host may not be the client's: say whose hardware this is.
        "hardware": hardware() + (" (the client's host)" if args.target == "openai" else ""),
        "checkpoint": args.checkpoint or args.model,
        "target": args.target,
        **({"url": args.url, "model": args.model} if args.target == "openai" else {}),
        "date": time.strftime("%Y-%m-%d"),
        "duration_s": args.duration,
        "burstiness": args.burstiness,
        "utterance_seconds": [args.min_seconds, args.max_seconds],
        "ttfa_target_ms": TTFA_TARGET_S * 1e3,
        "text_rate": args.text_rate or None,  # words per second of input streaming; None: whole texts
        "text_tail_frames": args.text_tail_frames,  # None: lengths U(utterance_seconds)
        "voice": args.speaker.default if isinstance(args.speaker, VoiceMix) else args.speaker,
        "voice_mix": args.voice_mix or None,
        "client_processes": args.client_processes,
        "proxy": args.proxy,
        "proxy_threads": args.proxy_threads if args.proxy else None,
    }
    # A run cut short (`timeout` sends SIGTERM) still stops its servers, MPS daemons and Python stubs
    # (run_policy's `finally`), which would otherwise hold the GPU beside the next run's server, and
    # keeps every probe it finished: the outputs are rewritten after each one.
    TERMINATION.install()
    results: list[dict] = []
    with client_processes(args.client_processes) as args.client_pool:
        for policy in args.policies.split(","):

            def probed(partial: dict, finished: list[dict] = list(results)) -> None:
                write_outputs(args, finished + [partial], meta, echo=False)

            results.append(run_policy(args, policy, probed))
            write_outputs(args, results, meta)


if __name__ == "__main__":
    main()
