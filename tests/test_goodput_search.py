"""The goodput search of benchmarks/serving_bench.py, against a known capacity (no server)."""

from __future__ import annotations

import pytest

from voxtriton.bench.goodput import search_goodput
from voxtriton.bench.summary import RequestResult, timeline


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
