"""Goodput: the highest arrival rate whose probes meet the listener's targets, by either definition:
strict (p90 TTFA <= 200 ms, nothing stalled or failed) or SLO attainment (at least 99% of requests
start within 200 ms and never stall)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from voxtriton.bench.summary import attains_target, meets_target


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


def probes(run: Path) -> list[dict]:
    """Every open-loop probe of one run, labelled by model, policy and run."""
    result = json.loads((run / "results.json").read_text())
    command = result["meta"]["command"]
    checkpoint = result["meta"]["checkpoint"]
    model = (re.search(r"ck-([\w.]+)", checkpoint) or re.search(r"([^/]+)/?$", checkpoint)).group(1)
    rows = []
    for entry in result["policies"]:
        trials = (entry.get("goodput") or {}).get("trials", []) + entry.get("rates", [])
        for trial in trials:
            server = trial["server"] or {}  # None for a server the harness cannot read (another system)
            rows.append(
                {
                    "model": model,
                    "policy": entry["policy"],
                    "gpus": entry.get("gpus") or None,  # None: not known (an endpoint, an older run)
                    "run": run.name,
                    "rate": trial["rate"],
                    "passed": meets_target(trial),
                    "attained": attains_target(trial),  # None for runs from before the definition
                    "slo_attainment": trial.get("slo_attainment"),
                    "stalled": trial["stalled_requests"],
                    "requests": trial["requests"],
                    "ttfa_p90_ms": trial["ttfa_p90_ms"],
                    "stall_total_s": round(trial["stall_total_s"], 3),
                    "listeners_peak": trial["listeners_peak"],
                    # A client that fell behind delays its reads: TTFA and stalls then are partly its.
                    "client_loop_lag_max_ms": trial.get("client_loop_lag_max_ms"),
                    "frame_step_ms": server.get("frame_step_ms_mean"),
                    # For gpu_budget.py; runs of older harness versions may lack them.
                    "completed": trial.get("completed"),
                    "audio_s": trial.get("audio_s"),
                    "frame_step_batch": server.get("frame_step_batch_mean"),
                    "command": command,
                }
            )
    return rows


SAME_RATE = 0.005  # relative difference under which two probes count as one rate


def same_rate(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_RATE * max(a, b)


def goodput(rows: list[dict], verdict: str = "passed") -> dict:
    """By the probes' `verdict` (a key: True passed, False failed, None not judged), the highest rate
    passed in any probe ("goodput", with "passes" = passed / probes at that rate), the highest passed
    in most of its probes ("goodput_most"), and the lowest failed."""
    rows = [r for r in rows if r[verdict] is not None]

    def tally(rate):
        probes = [r for r in rows if same_rate(r["rate"], rate)]
        return sum(r[verdict] for r in probes), len(probes)

    passed = [r["rate"] for r in rows if r[verdict]]
    failed = [r["rate"] for r in rows if not r[verdict]]
    best = max(passed, default=None)
    mostly = [rate for rate in passed if 2 * tally(rate)[0] > tally(rate)[1]]
    listeners = max((r["listeners_peak"] for r in rows if r[verdict] and r["rate"] == best), default=None)
    return {
        "goodput": best,
        "passes": "{} of {}".format(*tally(best)) if best is not None else None,
        "goodput_most": max(mostly, default=None),
        "lowest_failed": min(failed, default=None),
        "listeners_peak": listeners,
    }
