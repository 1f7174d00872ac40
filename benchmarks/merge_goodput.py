"""Merge the probes of several serving_bench runs (results.json each) into one goodput table and plot.

Near its limit a policy passes or fails a probe by a few stalled requests out of hundreds, so one
rate can pass in one run and fail in another. This lists every probe and credits each model and
policy with the highest rate it passed in any run, with how many of that rate's probes passed, next
to a stricter figure (the highest rate passed in most of its probes) and the lowest rate it failed.
Probes within 0.5% of each other count as one rate (a bisection's 22.5497 and a fixed 22.55).

    python benchmarks/merge_goodput.py --out benchmarks/results/goodput_h200 DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_bench import meets_target  # noqa: E402


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
            rows.append(
                {
                    "model": model,
                    "policy": entry["policy"],
                    "run": run.name,
                    "rate": trial["rate"],
                    "passed": meets_target(trial),
                    "stalled": trial["stalled_requests"],
                    "requests": trial["requests"],
                    "ttfa_p90_ms": trial["ttfa_p90_ms"],
                    "stall_total_s": round(trial["stall_total_s"], 3),
                    "listeners_peak": trial["listeners_peak"],
                    "frame_step_ms": trial["server"]["frame_step_ms_mean"],
                    # For gpu_budget.py; runs of older harness versions may lack them.
                    "completed": trial.get("completed"),
                    "audio_s": trial.get("audio_s"),
                    "frame_step_batch": trial["server"].get("frame_step_batch_mean"),
                    "command": command,
                }
            )
    return rows


SAME_RATE = 0.005  # relative difference under which two probes count as one rate


def same_rate(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_RATE * max(a, b)


def goodput(rows: list[dict]) -> dict:
    """The highest rate passed in any probe ("goodput", with "passes" = passed / probes at that rate),
    the highest passed in most of its probes ("goodput_most"), and the lowest failed."""

    def tally(rate):
        probes = [r for r in rows if same_rate(r["rate"], rate)]
        return sum(r["passed"] for r in probes), len(probes)

    passed = [r["rate"] for r in rows if r["passed"]]
    failed = [r["rate"] for r in rows if not r["passed"]]
    best = max(passed, default=None)
    mostly = [rate for rate in passed if 2 * tally(rate)[0] > tally(rate)[1]]
    listeners = max((r["listeners_peak"] for r in rows if r["passed"] and r["rate"] == best), default=None)
    return {
        "goodput": best,
        "passes": "{} of {}".format(*tally(best)) if best is not None else None,
        "goodput_most": max(mostly, default=None),
        "lowest_failed": min(failed, default=None),
        "listeners_peak": listeners,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [row for run in args.runs for row in probes(run)]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["policy"]), []).append(row)
    summary = {f"{model} {policy}": goodput(group) for (model, policy), group in sorted(groups.items())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"goodput": summary, "probes": rows}, indent=1))
    lines = [
        "| model | policy | goodput (req/s) | probes passed at it | passed in most probes (req/s) "
        "| lowest failing rate | peak listeners at goodput |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {key.split()[0]} | {key.split()[1]} | {_rate(value['goodput'])} | {value['passes']} | "
        f"{_rate(value['goodput_most'])} | {_rate(value['lowest_failed'])} | {value['listeners_peak']} |"
        for key, value in summary.items()
    ]
    lines += [
        "",
        "| model | policy | run | rate/s | passed | stalled / requests | TTFA p90 ms | frame step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['policy']} | {r['run']} | {_rate(r['rate'])} | {'yes' if r['passed'] else 'no'} | "
        f"{r['stalled']} / {r['requests']} | {r['ttfa_p90_ms']} | {r['frame_step_ms']} |"
        for r in sorted(rows, key=lambda r: (r["model"], r["policy"], r["rate"], r["run"]))
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(groups, args.out / "ttfa_stalls_vs_rate.png")


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def plot(groups: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # an optional dependency (the `bench` extra): the tables are written without it
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (model, policy), group in sorted(groups.items()):
        group = sorted(group, key=lambda r: r["rate"])
        label = f"{model} {policy}"
        left.scatter([r["rate"] for r in group], [r["ttfa_p90_ms"] for r in group], label=label)
        right.scatter([r["rate"] for r in group], [r["stalled"] / r["requests"] for r in group], label=label)
    left.axhline(200, color="gray", linestyle="--")
    left.set(xlabel="arrival rate (req/s)", ylabel="p90 TTFA (ms)", title="p90 TTFA (every probe)")
    right.set(
        xlabel="arrival rate (req/s)", ylabel="stalled fraction", title="stalled requests (every probe)"
    )
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
