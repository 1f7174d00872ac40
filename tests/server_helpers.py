"""Start real tritonservers for tests and read their metrics."""

from __future__ import annotations

import re
import time
import urllib.request

from voxtriton.serving.launcher import TritonServer


def start_server(checkpoint, policy: str | None = None, parameters: dict | None = None) -> TritonServer:
    """A tritonserver on free loopback ports with the voxtriton repository (CPU in CI)."""
    server = TritonServer(checkpoint=str(checkpoint), policy=policy, parameters=parameters, use_mps=False)
    return server.start(timeout=300)


def metrics(server: TritonServer) -> dict[str, float]:
    """voxtriton_* samples from the Prometheus endpoint: {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(voxtriton_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def wait_for_metric(server: TritonServer, name: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = metrics(server).get(name)
        if value is not None and predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"metric {name} = {value} did not reach the expected value in {timeout} s")
