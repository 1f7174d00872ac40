"""Start real tritonservers for tests and read their metrics."""

from __future__ import annotations

import os
import queue
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc as grpcclient
from voxtriton_client.api import request_inputs

from voxtriton.serving.launcher import TritonServer


def start_server(checkpoint, policy: str | None = None, parameters: dict | None = None) -> TritonServer:
    """A tritonserver on free loopback ports with the voxtriton repository (CPU in CI), for
    `with start_server(...) as server:`, which starts it and stops it at the block's end."""
    return TritonServer(checkpoint=str(checkpoint), policy=policy, parameters=parameters, use_mps=False)


@dataclass(frozen=True)
class Process:
    name: str  # the command's name, as the kernel keeps it
    parent: int
    group: int
    arguments: tuple[str, ...]


def live_processes() -> dict[int, Process]:
    """Every process not yet a zombie, by pid (Linux /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found[int(pid)] = Process(name, int(fields[1]), int(fields[2]), tuple(arguments))
    return found


def processes_mentioning(marker: str) -> list[int]:
    """The live processes whose command line holds `marker`."""
    return [pid for pid, process in live_processes().items() if marker in "\0".join(process.arguments)]


def read_until_ready(launcher: subprocess.Popen, timeout: float = 240.0) -> list[str]:
    """The lines a `voxtriton serve` process printed up to the end of its ready message, or until it
    exited or `timeout` passed."""
    deadline = time.monotonic() + timeout
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if "  log: " in line or time.monotonic() > deadline:  # the last line of the ready message
            break
    return lines


def wait_for_metric(server: TritonServer, name: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = server.metrics().get(name)
        if value is not None and predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"metric {name} = {value} did not reach the expected value in {timeout} s")


def stream_and_abandon(url: str, text: str, after_chunks: int, how: str = "cancel", **options) -> int:
    """Start a long request, read `after_chunks` responses, then cancel (or drop the connection)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    options = {"speaker": "ryan", "max_frames": 1500, "ignore_eos": True, **options}
    client.async_stream_infer("tts", request_inputs(grpcclient, text, **options), request_id=uuid.uuid4().hex)
    seen = 0
    while seen < after_chunks:
        result, error = responses.get(timeout=60)
        assert error is None, error
        seen += 1
    if how == "cancel":
        client.stop_stream(cancel_requests=True)
        client.close()
    else:  # "disconnect": the connection drops under the open stream, as when a client dies
        client._channel.close()
    return seen


def stub_anon_and_shm_mb(server: TritonServer, model: str) -> float:
    """Anonymous and shared-memory resident memory (RssAnon + RssShmem) of a model's Python stub
    process, found by its model.py path: what a leak grows, on the heap or in the Python backend's
    shared-memory tensors. File-backed pages (mapped libraries and weights) are left out: under
    memory pressure the kernel drops them and pages them back in later, which once read as growth of
    290 MB in a clean-clone CI run beside another test run."""
    for pid in processes_mentioning(str(server.repository / model / "1" / "model.py")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return (int(fields["RssAnon"].split()[0]) + int(fields["RssShmem"].split()[0])) / 1024
    raise AssertionError(f"no stub process for {model}")
