"""Plot model_speed.py JSON results: frame step latency and real-time streams by batch size.

python benchmarks/plot_model_speed.py OUT.png LABEL=results.json [LABEL=results.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, series = Path(sys.argv[1]), [arg.split("=", 1) for arg in sys.argv[2:]]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    measured = set()
    for label, path in series:
        rows = json.loads(Path(path).read_text())["rows"]
        batches = [row["batch"] for row in rows]
        measured.update(batches)
        left.plot(batches, [row["frame_step_ms"] for row in rows], marker="o", label=label)
        right.plot(batches, [row["realtime_streams"] for row in rows], marker="o", label=label)
    left.set(
        xscale="log",
        xlabel="batch (streams)",
        ylabel="frame step (ms)",
        title="One frame for the whole batch",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="batch (streams)",
        ylabel="real-time streams",
        title="LM capacity (frames/s / 12.5)",
    )
    for axis in (left, right):  # the measured batches as plain numbers, no log-scale minor labels
        axis.set_xticks(sorted(measured), [str(batch) for batch in sorted(measured)])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
