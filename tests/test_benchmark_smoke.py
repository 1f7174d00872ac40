"""The serving benchmark harness runs end to end on CPU (so it cannot rot between GPU runs)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import live_processes

from voxtriton.bench.targets import TritonTarget
from voxtriton.bench.workload import arrivals, one_request

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]


def test_serving_benchmark_smoke(tmp_path, tiny_checkpoint):
    """A run whose servers serve a kernel's formula (VOXTRITON_KERNELS_OFF, inherited) says so in
    its command."""
    out = tmp_path / "bench"
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serving_bench.py"),
            "--smoke",
            "--checkpoint",
            str(tiny_checkpoint),
            "--warm-up-load",
            "2",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "VOXTRITON_KERNELS_OFF": "one_row_linear"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["command"].startswith("VOXTRITON_KERNELS_OFF=one_row_linear ")
    [policy] = results["policies"]
    row, second = policy["rates"]  # the one rate, probed twice with different arrivals
    assert (row["rate"], row["repeat"]) == (1, 0) and (second["rate"], second["repeat"]) == (1, 1)
    assert second["failed"] == 0 and second["completed"] == second["requests"]
    assert row["requests"] >= 2 and row["failed"] == 0 and row["completed"] == row["requests"]
    assert 0 < row["ttfa_p50_ms"] < 5000 and row["rtf_median"] > 0
    assert row["client_loop_lag_p99_ms"] is not None and 1 <= row["listeners_peak"] <= row["completed"]
    assert row["host_load_1min"] >= 0 and row["host_cpus"] >= 1
    assert sum(window["requests"] for window in row["timeline"]) == row["requests"]
    assert sum(window["stalled"] for window in row["timeline"]) == row["stalled_requests"]
    assert row["server"]["frame_step_ms_mean"] > 0 and row["server"]["chunks"]["urgent"] >= row["completed"]
    assert (
        row["server"]["admit_ms_per_request"] > 0 and row["server"]["prefill_device_ms_per_request"] is None
    )  # CPU
    # The engine thread's CPU time outside the decode: some, and no more than those parts' wall time
    # (a thread's CPU time cannot exceed its wall time; 1% for the clocks being read apart).
    parts = row["server"]["frame_step_parts_ms_mean"]
    assert 0 < row["server"]["frame_step_host_cpu_ms_mean"] <= (parts["admit"] + parts["other"]) * 1.01 + 0.01
    urgent = row["server"]["codec_lanes"]["urgent"]
    assert 1 <= urgent["calls"] <= row["server"]["chunks"]["urgent"] and urgent["frames_per_call"] >= 1
    assert 0 < urgent["busy_fraction"] <= 1
    gauges = row["server"]["gauges"]  # sampled every 0.5 s during the probe
    assert gauges["samples"] >= 2 and gauges["failed_reads"] == 0
    assert 1 <= gauges["rows_in_use_max"] <= row["requests"]
    # Triton's own count of the urgent codec model's calls: one per lane call
    codec = row["server"]["codec_models"]["codec_urgent"]
    assert codec["calls"] == urgent["calls"] and 0 < codec["execute_ms"] <= codec["request_ms"]
    # The model's own time per call: the decode within its work on the request, within Triton's
    # execution (10% for the two sets of counters being flushed apart).
    assert 0 < codec["decode_ms"] <= codec["model_ms"] <= codec["execute_ms"] * 1.1
    # The smoke server checks for cancellations every 0.2 s (the default): a stream open through a
    # sweep was checked, and the watcher held the lock for part of the probe, not all of it.
    watcher = row["server"]["cancellation_watcher"]
    assert watcher["checks_per_s"] > 0 and watcher["us_per_check"] > 0 and 0 < watcher["lock_share"] < 1
    # Lengths are fixed per request (max_frames with ignore_eos): the audio is what was asked for. A
    # request that stalled does not attain the SLO.
    assert row["audio_s"] == pytest.approx(row["audio_asked_s"], rel=1e-9)
    assert row["slo_attained"] <= row["completed"] - row["stalled_requests"]
    assert row["slo_attainment"] == row["slo_attained"] / row["requests"]
    assert "| voxserve | 1 |" in (out / "results.md").read_text()
    warm_up = policy["warm_up"]  # at the lowest rate, kept apart from the probes
    assert warm_up["rate"] == 1 and warm_up["seconds"] == 2 and warm_up["requests"] >= 1
    assert warm_up["completed"] == warm_up["requests"]


def test_a_scaling_run_probes_a_fleet_behind_envoy_from_several_client_processes(tmp_path, tiny_checkpoint):
    """One server alone, then two behind Envoy (deploy/envoy's configuration), at rates per server,
    the load from two client processes: every arrival of both processes' schedules is served, through
    Envoy, to both servers."""
    out = tmp_path / "bench"
    command = [sys.executable, str(ROOT / "benchmarks" / "serving_bench.py"), "--smoke"]
    command += ["--checkpoint", str(tiny_checkpoint), "--warm-up-load", "0", "--out", str(out)]
    command += ["--policies", "voxserve@0,voxserve*2", "--rates-per-server", "--proxy", "envoy"]
    command += ["--proxy-threads", "1", "--client-processes", "2", "--keep-logs"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (results["meta"]["client_processes"], results["meta"]["proxy"]) == (2, "envoy")
    alone, fleet = results["policies"]
    assert (alone["policy"], alone["servers"]) == ("voxserve", 1)
    assert (fleet["policy"], fleet["servers"]) == ("voxserve x2 GPUs behind Envoy", 2)
    [one], [two] = alone["rates"], fleet["rates"]
    assert (one["rate"], two["rate"]) == (1, 2) and one["proxy"] is None  # one server: no proxy
    # each process sends its own arrivals at half the rate (seeds "0/0" and "0/1"; only the first's
    # first at the start), all of them served
    for row in (one, two):
        schedules = [list(arrivals(row["rate"] / 2, 6.0, 1.0, f"0/{i}", i == 0)) for i in range(2)]
        assert row["requests"] == sum(map(len, schedules)) and row["completed"] == row["requests"]
    # Envoy carried every stream of the probe, to both servers
    streams = two["proxy"]["streams_per_server"]
    assert sum(streams) == two["requests"] and min(streams) >= 1
    assert 0 <= two["proxy"]["busiest_thread"] <= two["proxy"]["cpu_cores"]  # 10 ms ticks: maybe 0
    assert two["server"]["chunks"]["urgent"] >= two["completed"]  # counted on the servers, summed
    assert (out / "envoy_voxserve_x2.log").exists()
    report = (out / "results.md").read_text()
    assert "Load path: 2 client process(es), Envoy (1 worker threads) in front" in report


def test_a_run_cut_short_keeps_its_finished_probes_and_stops_its_server(tmp_path, tiny_checkpoint):
    """`timeout` ends a run with SIGTERM: the probes it finished are in results.json, and it stopped
    its server itself (the server logged the signal), stubs included (the server's process group,
    which they share, is empty), rather than leaving them to die with it or linger."""
    out = tmp_path / "bench"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "serving_bench.py"),
                "--smoke",
                "--checkpoint",
                str(tiny_checkpoint),
                "--warm-up-load",
                "0",
                "--repeats",
                "3",
                "--keep-logs",
                "--out",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 180
        while not (out / "results.json").exists():  # written after the first probe
            assert process.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no probe finished in 180 s"
            time.sleep(0.2)
        [server] = [
            pid
            for pid, child in live_processes().items()
            if child.parent == process.pid and child.name == "tritonserver"
        ]
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
    [policy] = json.loads((out / "results.json").read_text())["policies"]
    assert 1 <= len(policy["rates"]) < 3 and policy["rates"][0]["completed"] >= 1
    assert "Signal (15) received" in (out / "server_voxserve.log").read_text()
    assert not [pid for pid, left in live_processes().items() if left.group == server]  # its own group


def test_sigterm_while_servers_stop_is_held_back_until_they_have_stopped():
    """Two SIGTERMs (as `timeout` sends, to the process and its group) inside `deferred()` (where
    serving_bench stops its servers) end the run once, after the block, with status 143."""
    script = (
        "import os, signal\n"
        "from voxtriton.bench.fleet import TERMINATION\n"
        "TERMINATION.install()\n"
        "with TERMINATION.deferred():\n"
        "    os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('servers stopped', flush=True)\n"
        "print('not reached')\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (completed.returncode, completed.stdout) == (128 + signal.SIGTERM, "servers stopped\n"), (
        completed.stderr[-2000:]
    )


def test_a_server_that_never_answers_fails_the_request_instead_of_hanging_the_probe():
    """A stand-in endpoint accepts connections and stays silent: the request ends as failed, with
    the reason, after the timeout."""

    async def scenario():
        connections = []

        async def accept_and_stay_silent(reader, writer):
            connections.append(writer)

        server = await asyncio.start_server(accept_and_stay_silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = TritonTarget([f"127.0.0.1:{port}"])
        try:
            started = time.perf_counter()
            result = await one_request(client, random.Random(0), (1.0, 2.0), None, timeout=0.5)
            return result, time.perf_counter() - started, len(connections)
        finally:
            await client.close()
            server.close()

    result, elapsed, connections = asyncio.run(scenario())
    assert result.error == "no final response within 0.5 s" and result.ttfa_s is None
    assert connections == 1 and elapsed < 5


@pytest.fixture(scope="module")
def csm_tiny(tmp_path_factory):
    from voxtriton.models.csm.checkpoint import make_csm_checkpoint

    return make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0)


@pytest.mark.parametrize("family", ["qwen3_tts", "csm"])
def test_single_stream_runs_any_family(tmp_path, tiny_checkpoint, csm_tiny, family):
    """single_stream.py times one stream through the serving code of the checkpoint's family."""
    checkpoint = tiny_checkpoint if family == "qwen3_tts" else csm_tiny
    out = tmp_path / "single.json"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "single_stream.py"), "--checkpoint", str(checkpoint)]
        + ["--runs", "2", "--frames", "12", "--device", "cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["family"] == family and result["peer"] == {"error": "skipped"}
    assert len(result["ours"]["ttfa_ms"]) == 2 and all(t > 0 for t in result["ours"]["ttfa_ms"])
    assert result["ours"]["rtf_median"] > 0


def test_serving_benchmark_drives_a_csm_server(tmp_path, csm_tiny):
    """The open-loop harness serves CSM as it serves Qwen3-TTS: every request plays to its asked length."""
    out = tmp_path / "bench"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving_bench.py"), "--smoke", "--checkpoint"]
        + [str(csm_tiny), "--warm-up-load", "0", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    [policy] = json.loads((out / "results.json").read_text())["policies"]
    [row] = policy["rates"]
    assert row["requests"] >= 1 and row["failed"] == 0 and row["completed"] == row["requests"]
    assert row["audio_s"] == pytest.approx(row["audio_asked_s"], rel=1e-9)
