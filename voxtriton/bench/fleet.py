"""The tritonservers under measurement: start, check, sample, stop (also on SIGTERM)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from voxtriton.bench.proxy import Envoy, healthy, render_config
from voxtriton.bench.summary import percentile
from voxtriton.bench.targets import TextFrames, TritonTarget
from voxtriton.kernels import FALLBACK_WARNING
from voxtriton.serving.launcher import TritonServer, free_ports, parse_params


class Fleet:
    """The servers of one measurement: one tritonserver (on GPU G with "POLICY@G"), or one per GPU
    ("POLICY*N"), which the load generator reaches least-loaded, as the gateway does, or, with
    `--proxy envoy`, through Envoy configured as deploy/envoy/ configures it."""

    def __init__(self, args, spec: str):
        self.allow_kernel_fallback = args.allow_kernel_fallback
        text_frames = None
        if args.text_tail_frames is not None:  # the interleaved layout takes one text id a frame
            text_frames = TextFrames(args.checkpoint, args.text_tail_frames)
        spec, _, pinned = spec.partition("@")
        self.policy, _, count = spec.partition("*")
        self.label = f"{self.policy} x{count} GPUs" if count else self.policy
        parameters = {
            "tts": {
                "max_streams": str(args.max_streams),
                "max_queued": str(args.max_queued),
                "max_draining": str(args.max_draining),
            }
        }
        for model, values in parse_params(args.param).items():
            parameters.setdefault(model, {}).update(values)
        gpus = range(int(count)) if count else [int(pinned) if pinned else None]
        self.servers = [
            TritonServer(
                checkpoint=args.checkpoint,
                policy=self.policy,
                parameters=parameters,
                tritonserver=args.tritonserver,
                gpu=gpu,
            )
            for gpu in gpus
        ]
        self.gpus = sum(server.gpus for server in self.servers)
        if not count and self.gpus > 1:  # one server whose codec models have a GPU of their own
            self.label += f" on {self.gpus} GPUs"
        self.proxy: Envoy | None = None
        self.proxy_ports: tuple[int, int] | None = None
        self.proxy_threads = args.proxy_threads
        if args.proxy == "envoy" and count:  # a fleet of POLICY*N; one server alone is reached directly
            self.label += " behind Envoy"
            self.proxy_ports = tuple(free_ports(2))  # its gRPC listener, its admin
            urls = [f"127.0.0.1:{self.proxy_ports[0]}"]
        else:
            urls = [server.grpc_url for server in self.servers]
        # picklable, so the load can come from several client processes (--client-processes)
        self.make_target = functools.partial(TritonTarget, urls, args.text_rate, text_frames)

    def start(self) -> None:
        for server in self.servers:  # they come up together (graph capture takes a while)
            server.launch()
        for server in self.servers:
            server.wait_ready(300)
        fallbacks = [
            line
            for server in self.servers
            for line in kernel_fallbacks(server.log_file.read_text(errors="replace"))
        ]
        if fallbacks and not self.allow_kernel_fallback:
            raise SystemExit(
                f"{len(fallbacks)} GPU kernel check(s) failed, so the server runs the slower PyTorch "
                f"formulas and would measure that, not the build (pass --allow-kernel-fallback to "
                f"measure it anyway); the first: {fallbacks[0]}"
            )
        if self.proxy_ports:
            self.start_proxy()

    def start_proxy(self) -> None:
        grpc_port, admin_port = self.proxy_ports
        tritons = [(server.local_host, server.grpc_port, server.http_port) for server in self.servers]
        workdir = self.servers[0].workdir
        config = render_config(tritons, grpc_port, admin_port)
        self.proxy = Envoy(config, admin_port, workdir, concurrency=self.proxy_threads)
        # Envoy's first health checks (each server's /v2/models/tts/ready) pass
        self.proxy.wait_until(
            lambda hosts: len(hosts) == len(tritons) and all(map(healthy, hosts.values())),
            "every server healthy",
            timeout=60,
        )

    def proxy_sample(self) -> dict | None:
        """Envoy's CPU time so far per thread and the streams it has sent each server (in GPU order),
        to difference over a probe."""
        if self.proxy is None:
            return None
        hosts = self.proxy.hosts()
        addresses = [f"{server.local_host}:{server.grpc_port}" for server in self.servers]
        return {
            "thread_cpu_s": self.proxy.thread_cpu_seconds(),
            "streams": [hosts[address]["rq_total"] for address in addresses],
        }

    def metrics(self) -> dict[str, float]:
        """Counters summed over the servers."""
        total: dict[str, float] = {}
        for server in self.servers:
            for name, value in server.metrics().items():
                total[name] = total.get(name, 0.0) + value
        return total

    def stop(self, logs: Path | None) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            if logs:
                logs.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.proxy.log, logs / f"envoy_{self.policy}_x{len(self.servers)}.log")
        for index, server in enumerate(self.servers):
            server.stop()
            if logs and server.log_file.exists():
                logs.mkdir(parents=True, exist_ok=True)
                suffix = f"_gpu{index}" if len(self.servers) > 1 else ""
                shutil.copyfile(server.log_file, logs / f"server_{self.policy}{suffix}.log")
            server.cleanup()


# The opening of voxtriton.kernels' fallback warning, for any kernel on a GPU: "Triton kernel NAME
# unavailable on cuda..." (re.escape leaves its %s placeholders as they are).
KERNEL_FALLBACK = re.compile(re.escape(FALLBACK_WARNING.split(" (")[0]) % (r"\w+", "cuda"))


def kernel_fallbacks(server_log: str) -> list[str]:
    """The server log's lines saying a Triton kernel failed its check on a GPU (voxtriton.kernels).
    Triton builds its launchers with $CC, so a CC that names no compiler makes every kernel fall back
    and the server would measure the slower PyTorch formulas."""
    return [line.strip() for line in server_log.splitlines() if KERNEL_FALLBACK.search(line)]


class GaugeSampler:
    """Reads the servers' gauges every `interval_s` while a probe runs, on a thread of its own (off
    the client's event loop): the streams generating (holding a KV-cache row), the requests
    waiting for a row and the streams draining (generated, audio still owed). A probe's means hide
    its steady state: a probe's busiest seconds can hold nearly twice its mean batch.
    A read parses the metrics page in Python, about a millisecond that the client's event loop may
    wait for the GIL; `client_loop_lag_*` would show it. With several servers the figures are sums
    over them, not per server."""

    def __init__(self, fleet: Fleet, interval_s: float = 0.5):
        self.fleet, self.interval_s = fleet, interval_s
        self.rows: list[float] = []
        self.waiting: list[float] = []
        self.draining: list[float] = []
        self.failed_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                metrics = self.fleet.metrics()
            except Exception:  # a server too busy to answer in time, a cut-off page: count it, go on
                self.failed_reads += 1
                continue
            self.rows.append(metrics.get("voxtriton_kv_rows_in_use", 0.0))
            self.waiting.append(metrics.get("voxtriton_waiting_requests", 0.0))
            self.draining.append(metrics.get("voxtriton_draining_streams", 0.0))

    def summary(self) -> dict:
        return {
            "samples": len(self.rows),
            "failed_reads": self.failed_reads,
            "rows_in_use_max": max(self.rows, default=None),
            "rows_in_use_p90": percentile(self.rows, 90),
            "waiting_for_row_max": max(self.waiting, default=None),
            "draining_max": max(self.draining, default=None),
        }


def settled_metrics(fleet: Fleet, timeout: float = 5.0) -> dict[str, float]:
    """The servers' metrics once their writers have applied everything queued (they apply updates
    every 0.1 s, see serving/triton_metrics.py): two reads 0.25 s apart that agree."""
    deadline = time.monotonic() + timeout
    previous = fleet.metrics()
    while True:
        time.sleep(0.25)
        current = fleet.metrics()
        if current == previous or time.monotonic() > deadline:
            return current
        previous = current


class Termination:
    """SIGTERM as SystemExit (so `finally` blocks run), once, and held back while servers stop:
    raised inside `TritonServer.stop` it would skip the kill of the stubs' process group and the
    MPS daemon's quit. (`timeout` signals the process and then its group: a second SIGTERM is
    ignored.)"""

    def __init__(self):
        self.requested, self.deferring = False, 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested = True
        if not self.deferring:
            sys.exit(128 + signum)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
            if self.requested and not self.deferring:
                sys.exit(128 + signal.SIGTERM)


TERMINATION = Termination()


def hardware() -> str:
    """The measuring host in a few words: the GPU and torch build, else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    except ImportError:
        pass
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
