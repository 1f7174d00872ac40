"""serving_bench's two paths to one server: gRPC straight to Triton, and the OpenAI-compatible HTTP
endpoint (our gateway in front of the same server) give the same figures for the same workload."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import start_server
from test_gateway import start_gateway, stop_gateway

from voxtriton.bench.summary import RequestResult, summarize
from voxtriton.bench.targets import Endpoint, TritonTarget
from voxtriton.bench.workload import open_loop

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]
# One request a second, nearly regular (burstiness 0.1), of 0.4-0.8 s of audio: on this small CPU the
# tiny model runs near real time, so streams seldom overlap and the paths, not queueing, are compared.
RATE, BURSTINESS, SECONDS = 1.0, 0.1, (0.4, 0.8)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with start_server(tiny_checkpoint) as server:
        gateway, url = start_gateway([server.grpc_url], tiny_checkpoint)
        try:
            yield server, url
        finally:
            stop_gateway(gateway)


def probe(make_target, seed: int, duration: float = 6.0) -> list[RequestResult]:
    results, _ = asyncio.run(open_loop(make_target, RATE, duration, BURSTINESS, SECONDS, seed, "ryan"))
    return results


def test_grpc_and_the_gateway_give_the_same_figures(stack):
    """The same arrivals (one seed) through both paths, twice each, alternating so that both meet the
    same background load. Exact: the requests, all completed, and the audio (its length is fixed per
    request: max_frames with ignore_eos, and the gateway's 16-bit PCM keeps every sample). Within
    noise: through the gateway a request takes an HTTP hop and a second process on this shared CPU,
    so its p50 TTFA may be higher, but by less than 150 ms. Stalls here come from other processes
    taking the CPU, so their counts differ from probe to probe (by up to 7 of 14 on a loaded 2-core
    machine); the bound (half the requests, at least 2) still catches a path that counts audio or time
    wrongly, which would stall all or none."""
    server, url = stack
    paths = {"direct": lambda: TritonTarget([server.grpc_url]), "gateway": Endpoint(url, "tts").make_target}
    for name, make_target in paths.items():  # warm both (the server's first requests, the connections)
        probe(make_target, 99, duration=2.0)
    results = {name: [] for name in paths}
    for _ in range(2):
        for name, make_target in paths.items():
            results[name] += probe(make_target, 7)
    direct, gateway = (summarize(results[name], []) for name in paths)
    assert direct["requests"] == gateway["requests"] >= 8
    assert direct["completed"] == gateway["completed"] == direct["requests"], (direct, gateway)
    assert direct["audio_s"] == pytest.approx(direct["audio_asked_s"], rel=1e-9)
    assert gateway["audio_s"] == pytest.approx(direct["audio_s"], rel=1e-9)
    assert gateway["audio_asked_s"] == direct["audio_asked_s"]
    assert 0 < direct["ttfa_p50_ms"] < 5000 and 0 < gateway["ttfa_p50_ms"] < 5000
    assert gateway["ttfa_p50_ms"] < direct["ttfa_p50_ms"] + 150, (
        direct["ttfa_p50_ms"],
        gateway["ttfa_p50_ms"],
    )
    bound = max(2, direct["requests"] // 2)
    assert abs(gateway["stalled_requests"] - direct["stalled_requests"]) <= bound, (direct, gateway)
    assert gateway["slo_attained"] + gateway["stalled_requests"] <= gateway["requests"]


def test_the_openai_target_from_the_command_line(stack, tmp_path):
    """serving_bench --target openai measures the endpoint it is given and starts no server: the
    report has the probes (open and closed loop), both goodput verdicts' inputs, and null where
    server metrics would be."""
    _, url = stack
    out = tmp_path / "bench"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "serving_bench.py"),
        "--target",
        "openai",
        "--url",
        url,
        "--model",
        "tts",
        "--voice",
        "ryan",
        "--label",
        "gateway",
        "--rates",
        "2",
        "--concurrency",
        "1",
        "--duration",
        "3",
        "--min-seconds",
        "1",
        "--max-seconds",
        "2",
        "--out",
        str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["target"] == "openai" and results["meta"]["url"] == url
    [system] = results["policies"]
    [row] = system["rates"]
    [single] = system["concurrency"]
    assert system["policy"] == "gateway" and row["server"] is None and single["server"] is None
    assert single["streams"] == 1 and single["completed"] >= 1
    assert row["requests"] >= 2 and row["completed"] == row["requests"] and row["failed"] == 0
    assert row["audio_s"] == pytest.approx(row["audio_asked_s"], rel=1e-9)
    assert 0 <= row["slo_attained"] <= row["requests"] and row["slo_attainment"] is not None
    assert "| gateway | 2 | " in (out / "results.md").read_text()
