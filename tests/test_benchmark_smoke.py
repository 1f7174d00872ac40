"""The serving benchmark harness runs end to end on CPU (so it cannot rot between GPU runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]


def test_serving_benchmark_smoke(tmp_path, tiny_checkpoint):
    out = tmp_path / "bench"
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving_bench.py"), "--smoke",
                                "--checkpoint", str(tiny_checkpoint), "--out", str(out)],
                               capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    [policy] = results["policies"]
    [row] = policy["rates"]
    assert row["requests"] >= 2 and row["failed"] == 0 and row["completed"] == row["requests"]
    assert 0 < row["ttfa_p50_ms"] < 5000 and row["rtf_median"] > 0
    assert row["client_loop_lag_p99_ms"] is not None and 1 <= row["listeners_peak"] <= row["completed"]
    assert row["server"]["frame_step_ms_mean"] > 0 and row["server"]["chunks"]["urgent"] >= row["completed"]
    assert "| voxserve | 1 |" in (out / "results.md").read_text()
