"""merge_goodput's rules on probes that disagree, as they do near a policy's limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from voxtriton.bench import goodput as merge_goodput

ROOT = Path(__file__).resolve().parents[1]


def probe(rate, passed, listeners=100):
    return {"rate": rate, "passed": passed, "listeners_peak": listeners}


def test_highest_pass_and_majority_rule():
    rows = [
        probe(22.5497, True),
        probe(22.55, True),
        probe(23.8747, False),
        probe(23.9, True, 316),
        probe(25.0, False),
        probe(21.3, True),
    ]
    result = merge_goodput.goodput(rows)
    assert result["goodput"] == 23.9 and result["passes"] == "1 of 2" and result["listeners_peak"] == 316
    assert result["goodput_most"] == 22.55  # 23.9 passed in only half of its probes
    assert result["lowest_failed"] == 23.8747


def test_rates_apart_by_more_than_half_a_percent_are_different_rates():
    result = merge_goodput.goodput(
        [probe(32.0, True), probe(32.2, False), probe(34.0, True), probe(34.0, True), probe(34.0, False)]
    )
    assert result["passes"] == "2 of 3" and result["goodput_most"] == 34.0
    assert merge_goodput.goodput([probe(30.0, False)]) == {
        "goodput": None,
        "passes": None,
        "goodput_most": None,
        "lowest_failed": 30.0,
        "listeners_peak": None,
    }


def test_merging_runs_writes_the_tables_with_or_without_matplotlib(tmp_path):
    """Two runs of one policy that disagree at 80 req/s: the command line merges them into one table
    (matplotlib is an optional extra: without it the plot is skipped, saying so)."""

    def trial(rate, stalled):
        return {
            "rate": rate,
            "failed": 0,
            "stalled_requests": stalled,
            "requests": 1600,
            "ttfa_p90_ms": 150.0,
            "stall_total_s": 0.1 * stalled,
            "listeners_peak": 900,
            "server": {"frame_step_ms_mean": 20.0},
        }

    runs = []
    for name, trials in (("a", [trial(76, 0), trial(80, 0)]), ("b", [trial(80, 2), trial(84, 14)])):
        runs.append(tmp_path / name)
        runs[-1].mkdir()
        meta = {"command": "serving_bench.py", "checkpoint": "/tmp/ck-1.7b"}
        (runs[-1] / "results.json").write_text(
            json.dumps({"meta": meta, "policies": [{"policy": "concurrent", "rates": trials}]})
        )
    out = tmp_path / "merged"
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "merge_goodput.py"), "--out", str(out), *map(str, runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    table = (out / "results.md").read_text()
    assert "| 1.7b | concurrent | 80.00 | 1 of 2 | 76.00 | 80.00 | 900 | - |" in table  # GPUs not known
    # (runs from before the harness counted SLO attainment: "-" there, and no attainment goodput)
    assert "| 1.7b | concurrent | b | 84.00 | no | - | 14 / 1600 | 150.0 | 20.0 |" in table
    assert "| 1.7b | concurrent | - | - | - | - | - | - |" in table
    assert (out / "ttfa_stalls_vs_rate.png").exists() or "matplotlib not installed" in completed.stderr


def test_both_definitions_for_a_system_without_server_metrics(tmp_path):
    """A run of an OpenAI-compatible endpoint (no server-side metrics: `server` is None): one stalled
    request in 200 fails the strict goodput and keeps the SLO attainment (199 of 200 >= 99%). The
    same endpoint on 2 GPUs (--gpus 2), its rates twice as high, is also given per GPU."""

    def trial(rate, stalled, attained, p90):
        return {
            "rate": rate,
            "requests": 200,
            "failed": 0,
            "completed": 200,
            "stalled_requests": stalled,
            "slo_attained": attained,
            "slo_attainment": attained / 200,
            "ttfa_p90_ms": p90,
            "stall_total_s": 0.2 * stalled,
            "listeners_peak": 30,
            "audio_s": 2000.0,
            "server": None,
        }

    run = tmp_path / "peer"
    run.mkdir()
    trials = [trial(2, 0, 200, 150.0), trial(3, 1, 199, 170.0), trial(4, 0, 150, 250.0)]
    meta = {"command": "serving_bench.py --target openai", "checkpoint": "/tmp/ck-1.7b"}
    (run / "results.json").write_text(
        json.dumps({"meta": meta, "policies": [{"policy": "vllm-omni", "rates": trials}]})
    )
    pair = tmp_path / "peer_2gpus"
    pair.mkdir()
    doubled = [
        trial(2 * t["rate"], t["stalled_requests"], t["slo_attained"], t["ttfa_p90_ms"]) for t in trials
    ]
    entry = {"policy": "vllm-omni on 2 GPUs", "gpus": 2, "rates": doubled}
    (pair / "results.json").write_text(json.dumps({"meta": meta, "policies": [entry]}))
    out = tmp_path / "merged"
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "merge_goodput.py"),
            "--out",
            str(out),
            str(run),
            str(pair),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    merged = json.loads((out / "results.json").read_text())["goodput"]["1.7b vllm-omni"]
    assert (merged["strict"]["goodput"], merged["strict"]["lowest_failed"]) == (2, 3)
    assert (merged["attainment"]["goodput"], merged["attainment"]["passes"]) == (3, "1 of 1")
    assert merged["attainment"]["lowest_failed"] == 4
    table = (out / "results.md").read_text()
    assert "| 1.7b | vllm-omni | peer | 3.00 | no | yes (99.5%) | 1 / 200 | 170.0 | - |" in table
    assert "| 1.7b | vllm-omni on 2 GPUs | 4.00 | 1 of 1 | 4.00 | 6.00 | 30 | 2.00 |" in table
    assert "| 1.7b | vllm-omni on 2 GPUs | 6.00 | 1 of 1 | 6.00 | 8.00 | 30 | 3.00 |" in table
