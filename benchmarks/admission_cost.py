"""The engine thread's cost of admitting requests: PyTorch calls and wall time per admission.

Each PyTorch call releases the GIL, and in the tts process other threads (codec lane workers,
response senders) want it: a thread that gave it away waits up to the interpreter's switch interval
to get it back. So an admission costs its calls' own time alone, and more beside a thread running
Python. This times `ModelRunner.prefill` (what the engine thread runs to admit a group of requests)
both ways, at each switch interval asked for, and counts the PyTorch calls it makes, and those of
`move_row` (a request leaving the batch). Without --graphs the counts also come as the graph path
makes them (`*_graph_path`): what a GPU replays as one graph (the padded prefill, the admitted rows'
writes, a row's move) counted as one call.

    python benchmarks/admission_cost.py                                    # CPU, tiny random checkpoint
    python benchmarks/admission_cost.py --preset 1.7b --device cuda --graphs  # GPU, as the server runs it

Checkpoints are random-weight (made into a temporary directory unless --checkpoint is given).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from voxtriton.bench.call_counter import GRAPHED, CallCounter
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_backbone
from voxtriton.models.random_checkpoint import make_checkpoint
from voxtriton.models.text import PromptBuilder, TextTokenizer

TEXT = "A sentence of about the length the benchmark's requests have, with a clause or two in it."


class PythonBeside:
    """A thread running Python until stopped, as the tts process's other threads do under load."""

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self):
        while not self.stop.is_set():
            sum(range(200))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "0.6b", "1.7b"))
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--graphs", action="store_true", help="CUDA graphs and a prefill stream, as the server (GPU)"
    )
    parser.add_argument("--groups", default="1,2,4", help="requests admitted together")
    parser.add_argument(
        "--switch-ms", default="5,0.5", help="switch intervals to time beside a Python thread"
    )
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":
        # One thread per operator: on a few cores PyTorch's own worker threads would compete with the
        # thread beside and blur what this measures (handing the GIL back and forth).
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    checkpoint = args.checkpoint or make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset)
    config = load_config(checkpoint)
    backbone = load_backbone(checkpoint, config, device=device, dtype=dtype)
    prompts = PromptBuilder(config, TextTokenizer(checkpoint))
    groups = [int(g) for g in args.groups.split(",")]
    stream = torch.cuda.Stream(device) if args.graphs else None
    runner = ModelRunner(
        backbone, max_rows=max(groups), max_positions=256, max_text_tokens=64, prefill_stream=stream
    )
    buckets = dict(
        batch_sizes=[1], spans=[256], prefill_batch_sizes=[1, 2, 4, 8], prefill_lengths=[32, 64, 128]
    )
    if args.graphs:
        runner.capture_graphs(**buckets)
    else:
        runner.set_buckets(**buckets)
    prompt = prompts.build(TEXT, "ryan")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def admit(group: int) -> float:
        """Wall time of one admission on this thread; the device's work is waited for outside it."""
        requests = [
            Request(f"r{i}", prompt, GenerationParams.create(config.generation, 400, seed=i))
            for i in range(group)
        ]
        started = time.perf_counter()
        runner.prefill(requests, 0)
        elapsed = time.perf_counter() - started
        sync()
        return elapsed

    def calls(work, as_replays=()) -> int:
        with CallCounter(runner, as_replays) as counter:
            work()
        return counter.calls

    default_interval = sys.getswitchinterval()
    rows = []
    for group in groups:
        move = lambda: runner.move_row(group - 1, 0, 40)  # noqa: E731 (the last admitted row into row 0)
        for _ in range(3):
            admit(group)
        row = {
            "group": group,
            "torch_calls": calls(lambda: admit(group)),
            "move_row_torch_calls": calls(move),
        }
        if not args.graphs:
            row["torch_calls_graph_path"] = calls(lambda: admit(group), GRAPHED)
            row["move_row_torch_calls_graph_path"] = calls(move, GRAPHED)
        row["alone_ms"] = statistics.median(admit(group) for _ in range(args.repeat)) * 1e3
        for switch_ms in (float(s) for s in args.switch_ms.split(",")):
            sys.setswitchinterval(switch_ms / 1e3)
            with PythonBeside():
                row[f"beside_python_{switch_ms:g}ms_ms"] = (
                    statistics.median(admit(group) for _ in range(args.repeat)) * 1e3
                )
        sys.setswitchinterval(default_interval)
        rows.append(row)
        print(
            ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
            flush=True,
        )
    meta = {
        "preset": args.preset,
        "device": str(device),
        "graphs": args.graphs,
        "prompt_tokens": len(prompt.text_ids),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(meta))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
