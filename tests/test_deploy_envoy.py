"""deploy/envoy/: Envoy in front of two real tritonservers (CPU, tiny random-weight checkpoint) and
the gateway, all on loopback. Streams pass through unchanged, new streams go to the server with the
fewest in flight, a killed server's streams end with an error and new ones go to the other, a frozen
server's streams end in bounded time, and with no server left a request fails at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from server_helpers import start_server, wait_for_metric
from test_gateway import post, start_gateway, stop_gateway
from voxtriton_client import TTSClient

from voxtriton.bench.proxy import ENVOY_DIR, Envoy, envoy_binary, healthy
from voxtriton.serving.gateway import Backend
from voxtriton.serving.launcher import free_ports

SERVED = 'nv_inference_count{model="tts",version="1"}'  # Triton's count of tts requests
LONG = dict(speaker="ryan", max_frames=1500, ignore_eos=True)  # about a minute of CPU time: cut short


def render(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ENVOY_DIR / "render.py"), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def validate(config: Path) -> subprocess.CompletedProcess:
    command = [envoy_binary(), "--mode", "validate", "-c", str(config), "--log-level", "error"]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


class Listener:
    """One long stream read on its own thread until `close()`: its chunks and how it ended."""

    def __init__(self, url: str):
        self.chunks = 0
        self.error: str | None = None
        self.ended_at: float | None = None
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        stream = TTSClient(url).stream("A long story.", timeout=60, **LONG)
        try:
            for chunk, synthesis in stream:
                if chunk is None:
                    self.error = synthesis.error
                else:
                    self.chunks += 1
                if self.closing.is_set():
                    break
        finally:
            stream.close()  # cancels the stream if it is still going
            self.ended_at = time.monotonic()

    def wait_for_chunks(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < count and self.ended_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.chunks >= count, f"{self.chunks} chunks within {timeout} s, error {self.error}"

    def close(self) -> None:
        self.closing.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the stream did not end within 30 s of its cancellation"


def test_the_config_and_a_rendered_one_pass_envoys_validation(tmp_path):
    assert validate(ENVOY_DIR / "envoy.yaml").returncode == 0
    rendered = render("--triton", "triton-0.triton:8001:8000", "--triton", "10.1.2.3:8011:8010")
    assert rendered.returncode == 0, rendered.stderr
    config = yaml.safe_load(rendered.stdout)
    (triton,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "triton"]
    [endpoints] = triton["load_assignment"]["endpoints"]
    assert [e["endpoint"]["health_check_config"]["port_value"] for e in endpoints["lb_endpoints"]] == [
        8000,
        8010,
    ]
    assert [listener["name"] for listener in config["static_resources"]["listeners"]] == ["grpc"]
    (tmp_path / "envoy.yaml").write_text(rendered.stdout)
    assert validate(tmp_path / "envoy.yaml").returncode == 0
    # Envoy's validation does reject a broken config (an unknown field here)
    (triton["outlier_detection"]).update(consecutive_five_xx=1)
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(config))
    broken = validate(tmp_path / "broken.yaml")
    assert broken.returncode != 0 and "consecutive_five_xx" in broken.stdout + broken.stderr


@pytest.mark.parametrize("argument", ["127.0.0.1:8001", "127.0.0.1:x:8000", ":8001:8000"])
def test_render_names_a_malformed_server_address(argument):
    result = render("--triton", argument)
    assert result.returncode != 0 and result.stderr.strip().endswith(
        f"--triton: expected HOST:GRPC_PORT:HTTP_PORT, got '{argument}'"
    )


def wait_for_health(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except urllib.error.HTTPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.fixture(scope="module")
def proxy(tiny_checkpoint, tmp_path_factory):
    """Two servers behind Envoy's gRPC listener, and a gateway (whose backend is that listener)
    behind Envoy's HTTP listener."""
    queue = {"tts": {"max_queued": "1024"}}  # room for more streams than Envoy's default limit
    first, second = (start_server(tiny_checkpoint, parameters=queue) for _ in range(2))
    grpc_port, http_port, admin_port = free_ports(3)
    envoy = gateway = None
    try:
        first.launch(), second.launch()  # both come up together
        first.wait_ready(300), second.wait_ready(300)
        # the gateway's one backend is Envoy's gRPC listener (unhealthy until Envoy is up)
        gateway, gateway_url = start_gateway(f"127.0.0.1:{grpc_port}", healthy=False)
        arguments = ["--gateway", gateway_url.removeprefix("http://")]
        arguments += ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]
        for server in (first, second):
            arguments += ["--triton", f"127.0.0.1:{server.grpc_port}:{server.http_port}"]
        rendered = render(*arguments, "--admin-port", str(admin_port))
        assert rendered.returncode == 0, rendered.stderr
        config = tmp_path_factory.mktemp("envoy") / "envoy.yaml"
        config.write_text(rendered.stdout)
        envoy = Envoy(config, admin_port, config.parent)
        # Envoy's first health checks (/v2/models/tts/ready on each HTTP port) pass
        envoy.wait_until(lambda hosts: len(hosts) == 2 and all(map(healthy, hosts.values())), "both healthy")
        yield envoy, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", first, second
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        if envoy is not None:
            envoy.stop()
        first.stop(), second.stop()
        first.cleanup(), second.cleanup()


@pytest.mark.server
def test_streams_pass_through_unchanged(proxy):
    _, url, _, first, _ = proxy
    options = dict(speaker="ryan", max_frames=30, ignore_eos=True, seed=4)
    through = TTSClient(url).synthesize("Through the proxy.", **options)
    direct = TTSClient(first.grpc_url).synthesize("Through the proxy.", **options)
    assert through.completed and through.error is None and len(through.chunks) >= 2
    # both servers load the same checkpoint: whichever served it, the audio is the same, sample for sample
    assert np.array_equal(through.audio, direct.audio) and len(through.audio) == 30 * 1920


@pytest.mark.server
def test_new_streams_go_to_the_server_with_the_fewest_in_flight(proxy):
    envoy, url, _, first, second = proxy
    listeners = []
    try:
        for _ in range(4):  # one at a time, each once the previous one streams
            listeners.append(Listener(url))
            listeners[-1].wait_for_chunks(1)
        for server in (first, second):  # the gauge is published a moment after the chunk went out
            wait_for_metric(server, "voxtriton_active_streams", lambda streams: streams == 2, timeout=5)
        # Envoy's own count agrees once any short call in flight (a readiness probe) has ended
        envoy.wait_until(
            lambda hosts: sorted(status["rq_active"] for status in hosts.values()) == [2, 2],
            "two streams in flight on each server",
            timeout=10,
        )
    finally:
        for listener in listeners:
            listener.close()
    for server in (first, second):  # cancelled through the proxy: the servers free their rows
        wait_for_metric(server, "voxtriton_active_streams", lambda value: value == 0)


@pytest.mark.server
def test_the_gateway_serves_behind_the_same_proxy(proxy):
    _, _, http, _, _ = proxy
    # the gateway's gRPC channel, refused before Envoy was up, reconnects after its backoff
    wait_for_health(http)
    with urllib.request.urlopen(http + "/health", timeout=10) as response:
        health = json.load(response)
    assert response.status == 200 and health["backend"]["ready"]
    body = {"model": "tts", "input": "Proxy, gateway, proxy.", "voice": "ryan", "max_frames": 20}
    code, headers, payload = post(http, {**body, "ignore_eos": True, "response_format": "pcm"})
    assert code == 200 and headers["content-type"] == "audio/pcm" and len(payload) == 20 * 1920 * 2


@pytest.mark.server
def test_more_streams_at_once_than_envoys_default_limit_all_reach_a_server(proxy):
    """Envoy's default circuit breakers cap a cluster at 1024 requests in flight, where a node of eight
    GPUs streams about 10,000. 1100 streams at once through the proxy on one connection (the servers
    queue what their rows do not hold): none is refused, all are in flight on the servers."""
    envoy, url, _, first, second = proxy
    count = 1100

    async def hold_streams() -> None:
        backend = Backend(url)
        calls = [asyncio.create_task(backend.synthesize("Many at once.", **LONG)) for _ in range(count)]
        try:
            deadline = time.monotonic() + 90
            while sum(status["rq_active"] for status in envoy.hosts().values()) < count:
                ended = [call for call in calls if call.done()]
                assert not ended, f"{len(ended)} ended early, the first: {ended[0].result().error}"
                assert time.monotonic() < deadline, f"{envoy.hosts()}"
                await asyncio.sleep(0.2)
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await backend.close()

    asyncio.run(hold_streams())
    for server in (first, second):  # cancelled through the proxy: the servers free their rows and queues
        wait_for_metric(server, "voxtriton_active_streams", lambda value: value == 0, timeout=60)


@pytest.mark.server
def test_a_killed_server_ends_its_streams_and_new_ones_go_to_the_other(proxy):
    """Last in this module: it kills the first server."""
    envoy, url, http, first, second = proxy
    # the streams of the tests above have ended on both sides of the proxy
    envoy.wait_until(
        lambda hosts: all(status["rq_active"] == 0 for status in hosts.values()),
        "no stream in flight",
        timeout=10,
    )
    streams = []
    try:
        for _ in range(2):  # one at a time, each once the previous one streams: one on each server
            streams.append(Listener(url))
            streams[-1].wait_for_chunks(2)
        for server in (first, second):  # the gauge is published a moment after the chunk went out
            wait_for_metric(server, "voxtriton_active_streams", lambda active: active == 1, timeout=5)
        served_before = second.metrics()[SERVED]
        killed_at = time.monotonic()
        os.killpg(first.process.pid, signal.SIGKILL)  # tritonserver and its stubs, no goodbye
        first.process.wait(10)
        deadline = time.monotonic() + 15
        while all(stream.ended_at is None for stream in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [stream for stream in streams if stream.ended_at is not None]
        assert len(ended) == 1, "the killed server's stream did not end within 15 s"
        (cut,) = ended
        assert cut.ended_at - killed_at < 15 and cut.error is not None and "RST_STREAM" in cut.error
        (survivor,) = [stream for stream in streams if stream is not cut]
        survivor.wait_for_chunks(survivor.chunks + 3)  # the other server's stream goes on
        # New streams, before and after Envoy's health checks notice: all served by the other server
        for _ in range(3):
            synthesis = TTSClient(url).synthesize("After.", speaker="ryan", max_frames=4, ignore_eos=True)
            assert synthesis.completed and synthesis.error is None and len(synthesis.audio) == 4 * 1920
        body = {"model": "tts", "input": "Still here.", "voice": "ryan", "max_frames": 4, "ignore_eos": True}
        code, _, payload = post(http, body)
        assert code == 200 and len(payload) == 44 + 4 * 1920 * 2
        assert second.metrics()[SERVED] == served_before + 4
        dead = f"127.0.0.1:{first.grpc_port}"
        envoy.wait_until(lambda hosts: not healthy(hosts[dead]), "the killed server marked unhealthy")
        assert healthy(envoy.hosts()[f"127.0.0.1:{second.grpc_port}"])
    finally:
        for stream in streams:
            stream.close()


@pytest.mark.server
def test_a_frozen_last_server_ends_its_streams_and_new_ones_fail_fast(proxy):
    """After the kill above: the one server left stops answering (SIGSTOP). Envoy's keepalive ends
    its stream in bounded time, its health checks mark the server down, and with no server left a
    new request fails at once."""
    envoy, url, _, first, second = proxy
    assert first.process is None or first.process.poll() is not None  # the test above killed it
    stream = Listener(url)
    try:
        stream.wait_for_chunks(2)
        frozen_at = time.monotonic()
        os.killpg(second.process.pid, signal.SIGSTOP)
        deadline = frozen_at + 25  # keepalive: a ping every 10 s, 5 s for its answer
        while stream.ended_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stream.ended_at is not None, "the frozen server's stream did not end within 25 s"
        assert stream.error is not None and "RST_STREAM" in stream.error
        frozen = f"127.0.0.1:{second.grpc_port}"
        envoy.wait_until(lambda hosts: not healthy(hosts[frozen]), "the frozen server marked unhealthy")
        asked_at = time.monotonic()
        synthesis = TTSClient(url).synthesize("Anyone?", speaker="ryan", max_frames=4, timeout=30)
        assert not synthesis.completed and "no healthy upstream" in synthesis.error, synthesis.error
        assert time.monotonic() - asked_at < 5
    finally:
        os.killpg(second.process.pid, signal.SIGCONT)
        stream.close()
