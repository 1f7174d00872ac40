"""Merge the probes of several serving_bench runs (results.json each) into one goodput table and plot.

Near its limit a policy passes or fails a probe by a few stalled requests out of hundreds, so one
rate can pass in one run and fail in another. This lists every probe and credits each model and
policy with the highest rate it passed in any run, with how many of that rate's probes passed, next
to a stricter figure (the highest rate passed in most of its probes) and the lowest rate it failed.
Probes within 0.5% of each other count as one rate (a bisection's 22.5497 and a fixed 22.55).
Each is given by both goodput definitions: strict (p90 TTFA <= 200 ms, no stalled or failed
request) and SLO attainment (at least 99% of requests start within 200 ms and never stall; probes
of runs from before the harness counted it are left out of that table). A system whose GPUs are
known (voxtriton's servers, an endpoint run with --gpus) is also given per GPU.

    python benchmarks/merge_goodput.py --out benchmarks/results/goodput_h200 DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from voxtriton.bench.goodput import goodput, probes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [row for run in args.runs for row in probes(run)]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["policy"]), []).append(row)
    summary = {
        system: {
            "gpus": max((row["gpus"] or 0 for row in group), default=0) or None,
            "strict": goodput(group),
            "attainment": goodput(group, "attained"),
        }
        for system, group in sorted(groups.items())
    }
    args.out.mkdir(parents=True, exist_ok=True)
    merged = {f"{model} {policy}": both for (model, policy), both in summary.items()}
    (args.out / "results.json").write_text(json.dumps({"goodput": merged, "probes": rows}, indent=1))
    lines = []
    for definition, title in (("strict", "goodput"), ("attainment", "SLO-attainment goodput")):
        lines += [
            f"| model | policy | {title} (req/s) | probes passed at it | passed in most probes (req/s) "
            "| lowest failing rate | peak listeners at goodput | per GPU (req/s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {model} | {policy} | {_rate(value['goodput'])} | {_cell(value['passes'])} | "
            f"{_rate(value['goodput_most'])} | {_rate(value['lowest_failed'])} | "
            f"{_cell(value['listeners_peak'])} | {_per_gpu(value['goodput'], both['gpus'])} |"
            for (model, policy), both, value in (
                (key, both, both[definition]) for key, both in summary.items()
            )
        ]
        lines.append("")
    lines += [
        "| model | policy | run | rate/s | passed | SLO attained | stalled / requests | TTFA p90 ms "
        "| frame step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['policy']} | {r['run']} | {_rate(r['rate'])} | "
        f"{'yes' if r['passed'] else 'no'} | {_attained(r)} | {r['stalled']} / {r['requests']} | "
        f"{r['ttfa_p90_ms']} | {_cell(r['frame_step_ms'])} |"
        for r in sorted(rows, key=lambda r: (r["model"], r["policy"], r["rate"], r["run"]))
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(groups, args.out / "ttfa_stalls_vs_rate.png")


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def _per_gpu(rate: float | None, gpus: int | None) -> str:
    """The goodput per GPU; "-" where there is none, or the system's GPU count is not known."""
    return "-" if rate is None or not gpus else f"{rate / gpus:.2f}"


def _cell(value) -> str:
    """A table cell; "-" where a figure does not exist (no goodput, or a peer without server metrics)."""
    return "-" if value is None else str(value)


def _attained(row: dict) -> str:
    """ "yes (99.4%)"; "-" for a probe from before the harness counted attainment."""
    if row["attained"] is None:
        return "-"
    share = "" if row["slo_attainment"] is None else f" ({100 * row['slo_attainment']:.1f}%)"
    return ("yes" if row["attained"] else "no") + share


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
        rates = sorted({r["rate"] for r in group})
        at = {rate: [r for r in group if r["rate"] == rate] for rate in rates}
        # One line per system through each rate's mean; every probe as a dot on it.
        line = left.plot(rates, [statistics.mean(r["ttfa_p90_ms"] for r in at[x]) for x in rates], marker="o")
        label, color = f"{model} {policy}", line[0].get_color()
        line[0].set_label(label)
        left.scatter([r["rate"] for r in group], [r["ttfa_p90_ms"] for r in group], color=color, s=12)
        stalled = [statistics.mean(r["stalled"] / r["requests"] for r in at[x]) for x in rates]
        right.plot(rates, stalled, marker="o", color=color, label=label)
        right.scatter(
            [r["rate"] for r in group], [r["stalled"] / r["requests"] for r in group], color=color, s=12
        )
    left.set_xscale("log")
    right.set_xscale("log")
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
