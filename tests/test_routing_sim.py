"""The routing simulation: the capacity curve read from the H200 results, and the policies' order."""

from pathlib import Path

import numpy as np
import pytest

from voxtriton.bench.routing_sim import goodput, read_capacity, simulate

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
FAST = dict(warm_up_s=6.0, measure_s=15.0)


def capacity(policy="voxserve"):
    return read_capacity(RESULTS / "goodput_h200.json", RESULTS / "single_stream_triton_h200.json", policy)


@pytest.mark.parametrize("policy", ["voxserve", "concurrent"])
def test_capacity_curves_are_monotone(policy):
    curve = capacity(policy)
    assert np.all(np.diff(curve.streams) > 0)
    assert np.all(np.diff(curve.ttfa_ms) >= 0)
    assert curve.streams[0] == 1 and curve.ttfa_ms[0] < 100
    assert curve.streams[1] < curve.stall_streams < 2 * curve.streams[-1]
    assert curve.goodput > 0


def test_least_request_beats_random_at_8_gpus():
    curve = capacity()
    assert goodput(curve, "least_request", 8, **FAST) >= goodput(curve, "random", 8, **FAST)
    load = 0.95 * curve.goodput
    least = simulate(curve, "least_request", 8, load, **FAST)
    random = simulate(curve, "random", 8, load, **FAST)
    assert random.ttfa_p99_ms > least.ttfa_p99_ms
    assert random.excess_p99 > least.excess_p99 > 0


def test_simulation_is_deterministic_for_a_seed():
    curve = capacity()
    runs = [simulate(curve, "k_proxies", 8, 110.0, seed=seed, **FAST) for seed in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy: 'fastest'"):
        simulate(capacity(), "fastest", 8, 100.0)
