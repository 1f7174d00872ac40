"""The goodput search of benchmarks/serving_bench.py against known capacities, and the two goodput
definitions (no server)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from pathlib import Path

import pytest

from voxtriton.bench.goodput import goodput, search_goodput
from voxtriton.bench.summary import RequestResult, attains_target, percentile, summarize, timeline, verdicts
from voxtriton.bench.workload import open_loop

ROOT = Path(__file__).resolve().parents[1]


def probe_log(capacity):
    probed = []

    def passes(rate):
        probed.append(rate)
        return rate <= capacity

    return probed, passes


def test_bisection_brackets_the_capacity():
    probed, passes = probe_log(17.0)
    rate, note = search_goodput(passes, 10.0, 30.0, 4)
    assert note is None and rate <= 17.0 < rate * (3.0 ** (1 / 16)) + 1e-9
    assert probed[:2] == [10.0, 30.0] and len(probed) == 6


def test_a_failing_low_rate_moves_the_bracket_down():
    probed, passes = probe_log(9.0)
    rate, note = search_goodput(passes, 16.0, 20.0, 3)
    # 16, 12.8 and 10.24 fail; 8.192 passes: the bisection goes on in [8.192, 10.24], not probing 10.24 again.
    assert probed[:5] == pytest.approx([16.0, 12.8, 10.24, 8.192, (8.192 * 10.24) ** 0.5])
    assert note is None and 8.192 - 1e-9 <= rate <= 9.0


def test_nothing_passing_and_everything_passing_say_so():
    assert search_goodput(probe_log(1.0)[1], 16.0, 20.0, 2) == (0.0, "no probe passed; lower --rate-low")
    assert search_goodput(probe_log(99.0)[1], 16.0, 20.0, 2) == (20.0, "target met at --rate-high; raise it")


def test_the_timeline_shows_when_stalls_began():
    """Requests grouped by when they were sent: the window where a probe went wrong stands out."""

    def result(sent_at, stall_s=0.0, ttfa_s=0.1, error=None):
        return RequestResult(sent_at, None if error else ttfa_s, stall_s, 5.0, 0.3, error)

    results = [
        result(100.0),
        result(100.5),
        result(101.9, ttfa_s=0.15),  # window 0: fine
        result(104.2, stall_s=0.4, ttfa_s=0.9),
        result(105.0, error="refused"),  # window 2
        result(103.0),
    ]  # window 1, listed out of order
    rows = timeline(results, window_s=2.0)
    assert [row["start_s"] for row in rows] == [0.0, 2.0, 4.0]
    assert [(row["requests"], row["failed"], row["stalled"]) for row in rows] == [
        (3, 0, 0),
        (1, 0, 0),
        (2, 1, 1),
    ]
    assert [row["ttfa_p90_ms"] for row in rows] == [150.0, 100.0, 900.0]
    assert timeline([]) == []


def slo_probe(late=0, stalled=0, failed=0, requests=100):
    """`requests` requests: `late` start after 200 ms, `stalled` stall, `failed` fail; the rest
    start in 100 ms and play through."""
    results = []
    for i in range(requests):
        if i < late:
            results.append(RequestResult(float(i), 0.35, 0.0, 5.0, 0.3, None))
        elif i < late + stalled:
            results.append(RequestResult(float(i), 0.1, 0.4, 5.0, 0.3, None))
        elif i < late + stalled + failed:
            results.append(RequestResult(float(i), None, 0.0, 0.0, None, "HTTP 503"))
        else:
            results.append(RequestResult(float(i), 0.1, 0.0, 5.0, 0.3, None))
    return summarize(results, [])


def test_slo_attainment_allows_one_request_in_a_hundred():
    """At least 99% of requests start within 200 ms and never stall: 1 late of 100 attains, 2 do not.
    A failed request counts against it as a late one does."""
    one, two = slo_probe(late=1), slo_probe(late=2)
    assert (one["slo_attained"], one["slo_attainment"]) == (99, 0.99) and attains_target(one)
    assert (two["slo_attained"], two["slo_attainment"]) == (98, 0.98) and not attains_target(two)
    assert attains_target(slo_probe(failed=1)) and not attains_target(slo_probe(failed=1, late=1))
    assert attains_target(slo_probe(late=2, requests=200)) and not attains_target(
        slo_probe(late=3, requests=200)
    )


def test_the_two_definitions_disagree_where_they_should():
    """One stall in 100 fails strict and keeps attainment; 5 late starts in 100 keep the p90 within
    200 ms (strict passes) and fail attainment. Both verdicts are recorded on each probe."""
    assert verdicts(slo_probe(stalled=1)) == {"meets": False, "attains": True}
    assert verdicts(slo_probe(late=5)) == {"meets": True, "attains": False}
    assert verdicts(slo_probe()) == {"meets": True, "attains": True}
    assert verdicts(slo_probe(late=20)) == {"meets": False, "attains": False}
    # A probe summarized before attainment was counted is not judged by it.
    old = {k: v for k, v in slo_probe().items() if k not in ("slo_attained", "slo_attainment")}
    assert verdicts(old) == {"meets": True, "attains": None}
    assert not attains_target(summarize([], []))


def test_goodput_by_each_verdict_skips_probes_not_judged():
    rows = [
        {"rate": 2.0, "passed": True, "attained": True, "listeners_peak": 5},
        {"rate": 3.0, "passed": False, "attained": True, "listeners_peak": 7},
        {"rate": 4.0, "passed": False, "attained": None, "listeners_peak": 9},
    ]
    assert goodput(rows)["goodput"] == 2.0 and goodput(rows)["lowest_failed"] == 3.0
    attained = goodput(rows, "attained")
    assert (attained["goodput"], attained["passes"], attained["lowest_failed"]) == (3.0, "1 of 1", None)


def test_one_search_per_definition_reuses_the_probes(monkeypatch, tmp_path):
    """serving_bench's goodput search, with probes whose verdicts follow known capacities (strict 10
    req/s, attainment 14 req/s): each search brackets its own capacity, and no rate and repeat is
    measured twice."""
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    measured = []

    def fake_probe(args, fleet, label, rate, duration, seed, progress=None):
        measured.append((rate, seed))
        return slo_probe(stalled=int(rate > 10), late=2 * int(rate > 14))

    monkeypatch.setattr(bench, "open_loop_probe", fake_probe)
    args = argparse.Namespace(
        goodput_rules=["strict", "attainment"],
        repeats=2,
        rate_low=4.0,
        rate_high=32.0,
        bisection_steps=5,
        duration=1.0,
        seed=0,
        rates_per_server=False,
    )
    found = bench.find_goodput(args, None, "peer")
    assert 10 * 8 ** (-1 / 32) <= found["strict"]["goodput"] <= 10
    assert 14 * 8 ** (-1 / 32) <= found["attainment"]["goodput"] <= 14
    assert len(measured) == len(set(measured)) == len(found["trials"])
    assert all(t["meets"] == (t["rate"] <= 10) and t["attains"] == (t["rate"] <= 14) for t in found["trials"])
    # The report gives each goodput with the probes passed at it (both repeats, each measured once)
    # and the peak listeners at the strict one (5: a request a second, 5 s of audio each).
    args.out = tmp_path
    meta = {"date": "today", "command": "serving_bench.py", "hardware": "CPU", "checkpoint": "/tmp/ck-tiny"}
    bench.write_outputs(args, [{"policy": "peer", "rates": [], "concurrency": [], "goodput": found}], meta)
    strict, attainment = found["strict"]["goodput"], found["attainment"]["goodput"]
    row = f"| peer | {strict:.2f} | 2 of 2 | {attainment:.2f} | 2 of 2 | 5 |  |"
    assert row in (tmp_path / "results.md").read_text()


def test_a_fleet_is_given_per_gpu_against_one_gpu_alone_not_as_a_baseline(tmp_path):
    """A scaling run (one server, then 8 behind the proxy, and `disaggregated` on two GPUs): each
    result on several GPUs per GPU as a fraction of linear, by each definition, against its policy on
    one GPU, else voxserve's; the baseline ratio compares results on one GPU only."""
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def searched(policy, gpus, strict, attainment):
        trials = [
            {"rate": strict, "meets": True, "attains": True, "listeners_peak": 10},
            {"rate": attainment, "meets": False, "attains": True, "listeners_peak": 12},
        ]
        found = {"trials": trials, "strict": {"goodput": strict}, "attainment": {"goodput": attainment}}
        # one server (disaggregated), one per GPU (a fleet), or none the harness started (an endpoint)
        servers = 1 if policy.startswith("disaggregated") else 0 if policy.startswith("vllm") else gpus
        result = {"policy": policy, "servers": servers, "gpus": gpus, "goodput": found}
        return result | {"rates": [], "concurrency": []}

    results = [
        searched("voxserve", 1, 100.0, 110.0),
        searched("concurrent", 1, 80.0, 88.0),
        searched("voxserve x8 GPUs behind Envoy", 8, 760.0, 880.0),
        searched("disaggregated on 2 GPUs", 2, 120.0, 130.0),
    ]
    lines = bench.goodput_table(results)
    fleet = "voxserve x8 GPUs behind Envoy"
    assert f"strict: {fleet}: 95.00 req/s per GPU, 0.95x linear (voxserve on one GPU: 100.00)" in lines
    assert f"attainment: {fleet}: 110.00 req/s per GPU, 1.00x linear (voxserve on one GPU: 110.00)" in lines
    assert (
        "strict: disaggregated on 2 GPUs: 60.00 req/s per GPU, 0.60x linear (voxserve on one GPU: 100.00)"
    ) in lines
    assert "strict: voxserve / best baseline = 1.25x" in lines  # concurrent, not the fleets
    # A peer's endpoint on 2 GPUs: against the same peer on one GPU in the run, else per GPU alone
    peer = searched("vllm-omni on 2 GPUs", 2, 5.0, 6.0)
    lines = bench.goodput_table([searched("vllm-omni", 1, 3.0, 4.0), peer])
    assert (
        "strict: vllm-omni on 2 GPUs: 2.50 req/s per GPU, 0.83x linear (vllm-omni on one GPU: 3.00)" in lines
    )
    lines = bench.goodput_table([peer])
    assert "attainment: vllm-omni on 2 GPUs: 3.00 req/s per GPU (no result on one GPU in this run)" in lines
    # A search that ended at its range's top found a bound: no ratio, and the reason
    results[2]["goodput"]["strict"]["note"] = "target met at --rate-high; raise it"
    lines = bench.goodput_table(results)
    assert (
        f"strict: {fleet}: 95.00 req/s per GPU, no ratio (the 8 GPUs' search: target met at "
        "--rate-high; raise it) (voxserve on one GPU: 100.00)"
    ) in lines
    # The probes of a goodput-only run (no fixed rates) are listed with what the load path used
    meta = {"date": "d", "command": "c", "hardware": "h", "checkpoint": "k", "client_processes": 2}
    meta.update(proxy="envoy", proxy_threads=2)
    for r in results:
        for trial in r["goodput"]["trials"]:
            trial.update(client_loop_lag_p99_ms=3.5, proxy=None)
    proxy = {"cpu_cores": 1.5, "busiest_thread": 0.9, "streams_per_server": [5, 6]}
    results[2]["goodput"]["trials"][0]["proxy"] = proxy
    path = "\n".join(bench.load_path(results, meta))
    assert "voxserve 100/s: lag 3.5;" in path
    assert f"{fleet} 760/s: lag 3.5, Envoy 1.5 cores (busiest thread 0.9), streams per server 5/6" in path


def test_percentiles_are_nearest_rank():
    """Of 88 requests one over the target: p99 is that one (a rounded index gave the one below)."""
    ttfas = [0.1] * 86 + [0.19, 0.25]
    assert percentile(ttfas, 99) == 0.25 and percentile(ttfas, 90) == 0.1
    assert percentile(list(range(1, 11)), 90) == 9 and percentile([3.0], 50) == 3.0
    assert percentile([], 90) is None


class LateClient:
    """A target whose first request holds the event loop (a client falling behind its arrivals):
    each request notes when it was due (`sent`) and when it actually began."""

    def __init__(self):
        self.times = []

    async def request(self, utterance, speaker, sent):
        began = time.perf_counter()
        if not self.times:
            time.sleep(0.3)  # blocks the loop: the next arrivals come late
        self.times.append((sent, began))
        return RequestResult(sent, 0.01, 0.0, utterance.seconds, 0.5, None, asked_s=utterance.seconds)

    async def close(self):
        pass


def test_an_open_loop_times_each_request_from_its_arrival_not_from_when_the_client_got_to_it():
    """A client behind its arrival schedule adds its delay to the requests' times (they count from
    `sent`), instead of hiding it: the coordinated omission of a closed loop."""
    client = LateClient()
    results, _ = asyncio.run(open_loop(lambda: client, 50.0, 1.0, 1.0, (1, 2), 7, None))
    assert len(results) == len(client.times) > 20
    late = [began - sent for sent, began in client.times[1:]]
    assert max(late) > 0.2, late  # due while the loop was held, begun after
    assert all(second >= first for (first, _), (second, _) in zip(client.times, client.times[1:]))
