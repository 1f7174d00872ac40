"""merge_goodput's rules on probes that disagree, as they do near a policy's limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("merge_goodput", ROOT / "benchmarks" / "merge_goodput.py")
merge_goodput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(merge_goodput)


def probe(rate, passed, listeners=100):
    return {"rate": rate, "passed": passed, "listeners_peak": listeners}


def test_highest_pass_and_majority_rule():
    rows = [probe(22.5497, True), probe(22.55, True), probe(23.8747, False), probe(23.9, True, 316),
            probe(25.0, False), probe(21.3, True)]
    result = merge_goodput.goodput(rows)
    assert result["goodput"] == 23.9 and result["passes"] == "1 of 2" and result["listeners_peak"] == 316
    assert result["goodput_most"] == 22.55  # 23.9 passed in only half of its probes
    assert result["lowest_failed"] == 23.8747


def test_rates_apart_by_more_than_half_a_percent_are_different_rates():
    result = merge_goodput.goodput([probe(32.0, True), probe(32.2, False), probe(34.0, True), probe(34.0, True),
                                    probe(34.0, False)])
    assert result["passes"] == "2 of 3" and result["goodput_most"] == 34.0
    assert merge_goodput.goodput([probe(30.0, False)]) == {
        "goodput": None, "passes": None, "goodput_most": None, "lowest_failed": 30.0, "listeners_peak": None}
