"""`TritonServer`: start tritonserver over a rendered repository, wait until it is ready, stop it
with every process it started; a context manager used by `voxtriton serve`, tests and benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from ..serving.drain import done_marker
from ..serving.pool_files import remove_orphans
from .gpus import MPSDaemon, gpu_count, pinned_device
from .repository import CODEC_MODELS, REPOSITORY, SECOND_GPU, model_overrides, render_repository
from .tritonserver import find_tritonserver

# A glog error line: "E1204 15:50:13.689261 16080 model_lifecycle.cc:642] message".
# The server's own endpoints are local: never through an http_proxy the environment sets.
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
LOG_ERROR = re.compile(r"^E\d{4} [\d:.]+ +\d+ [^\]]+\] +(.*)$")
# A region Triton makes in POSIX shared memory (/dev/shm on Linux) for a Python backend stub.
STUB_REGION = re.compile(r"/dev/shm/triton_python_backend_shm_region_[0-9a-f-]+")


class StartFailed(RuntimeError):
    """tritonserver exited, or was not ready in time: `reason` in one line; str() adds the log's tail."""

    def __init__(self, reason: str, log_tail: str):
        super().__init__(f"{reason}; log:\n{log_tail}")
        self.reason = reason


class StartTimedOut(StartFailed, TimeoutError):
    pass


def free_ports(count: int, taken: tuple[int, ...] = ()) -> list[int]:
    """`count` distinct local ports free now, none of `taken`. Their sockets stay bound until all are
    picked: one at a time, the system may hand the same port out twice."""
    with contextlib.ExitStack() as stack:
        ports = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            if (port := sock.getsockname()[1]) not in taken:
                ports.append(port)
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def die_with_parent() -> None:
    """In the child before exec: SIGKILL this process when the thread that launched it exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class TritonServer:
    """tritonserver over a rendered model repository; a context manager that leaves nothing behind."""

    def __init__(
        self,
        *,
        checkpoint: str | None = None,
        policy: str | None = None,
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        repository: Path = REPOSITORY,
        tritonserver: str | None = None,
        parameters: dict[str, dict[str, str]] | None = None,
        log_file: Path | None = None,
        use_mps: bool | None = None,
        extra_args: list[str] | None = None,
        gpu: int | None = None,
    ):
        """gpu: pin the server (and its MPS daemon) to this one GPU, e.g. one server per GPU; counted
        among the GPUs CUDA_VISIBLE_DEVICES allows when it is set."""
        self.install = find_tritonserver(tritonserver)
        self.pinned = {"CUDA_VISIBLE_DEVICES": pinned_device(gpu)} if gpu is not None else {}
        gpus = 1 if gpu is not None else gpu_count()
        self.workdir = Path(tempfile.mkdtemp(prefix="voxtriton-"))
        parameters = parameters or {}
        # `drain`: a file of the server's own, unless the deployment named one.
        tts = {"drain_file": str(self.workdir / "drain"), **parameters.get("tts", {})}
        self.drain_file = Path(tts["drain_file"]) if tts["drain_file"] else None
        self.host = host
        given = (grpc_port, http_port, metrics_port)
        picked = iter(free_ports(sum(not port for port in given), taken=given))
        self.grpc_port, self.http_port, self.metrics_port = (port or next(picked) for port in given)
        try:
            overrides = model_overrides(checkpoint, policy, gpus, {**parameters, "tts": tts})
            self.repository = render_repository(repository, self.workdir / "models", overrides)
            # the GPUs it computes on: two where its policy gave the codec models the second
            codec_devices = {overrides.get(model, {}).get("device") for model in CODEC_MODELS}
            self.gpus = 2 if SECOND_GPU in codec_devices else 1
        except BaseException:
            self.cleanup()
            raise
        self.log_file = log_file or self.workdir / "tritonserver.log"
        self.mps = (
            MPSDaemon(self.workdir, self.pinned) if (gpus > 0 if use_mps is None else use_mps) else None
        )
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None
        self.stub_regions: set[str] = set()  # paths, see `python_stub_regions`

    @property
    def local_host(self) -> str:
        """Where this machine reaches the server: its --host, or loopback when it listens on all."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self.local_host}:{self.grpc_port}"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The Python stub derives its sys.path from the first python3 on PATH: make it ours.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # The stub links libpython dynamically: give it this interpreter's (pyenv and venv builds
        # keep theirs outside the system library path, and extension modules need the matching one).
        libdir = sysconfig.get_config_var("LIBDIR")
        library_path = self.install.library_path + ([libdir] if libdir else [])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(library_path + [env.get("LD_LIBRARY_PATH", "")])
        env |= self.pinned
        if self.mps is not None:
            env |= self.mps.client_environment(env.get("CUDA_VISIBLE_DEVICES"))
        return env

    def command(self) -> list[str]:
        command = [
            str(self.install.server),
            "--model-repository",
            str(self.repository),
            "--grpc-address",
            self.host,
            "--grpc-port",
            str(self.grpc_port),
            "--http-address",
            self.host,
            "--http-port",
            str(self.http_port),
            "--metrics-address",
            self.host,
            "--metrics-port",
            str(self.metrics_port),
            "--exit-timeout-secs",
            "10",
            # explicit mode lets the tts model reload a codec lane whose process died, and load after
            # the server started (`wait_ready`)
            "--model-control-mode",
            "explicit",
            *[argument for model in CODEC_MODELS for argument in ("--load-model", model)],
        ]
        if self.install.backend_dir is not None:
            command += ["--backend-directory", str(self.install.backend_dir)]
        return command + self.extra_args

    def start(self, timeout: float = 300.0) -> "TritonServer":
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> None:
        """Start MPS and tritonserver without waiting (several servers can then come up together).
        Call from a thread that outlives the server: the server is killed when that thread exits."""
        if self.process is not None:
            # A second server on these ports would fail to bind them only after loading its models,
            # wait_ready would meanwhile see this one answer, and stop() would end only the second.
            raise RuntimeError(f"tritonserver already started on gRPC port {self.grpc_port}; stop() it first")
        if self.mps is not None:
            self.mps.start()
        log = open(self.log_file, "ab")
        # A new session, so stop() can end the server and every stub process it started; and killed
        # with us if we die without stopping it (its stubs follow their parent).
        self.process = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.local_host}:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise StartFailed(f"tritonserver exited with code {code}", self.log_tail())
            try:
                with LOCAL.open(url, timeout=2) as response:
                    if response.status == 200:
                        return self._load_scheduler(deadline)
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise StartTimedOut(f"tritonserver not ready after {timeout:.0f} s", self.log_tail())

    def _load_scheduler(self, deadline: float) -> None:
        """Load the tts model once the server is up: its warm-up calls the codec models through BLS,
        which Triton refuses while the server starts; the server is ready again once it is warm."""
        url = f"http://{self.local_host}:{self.http_port}/v2/repository/models/tts/load"
        request = urllib.request.Request(url, data=b"", method="POST")
        try:
            LOCAL.open(request, timeout=max(1.0, deadline - time.monotonic())).close()
            self.stub_regions |= python_stub_regions(self.process.pid)
        except OSError:  # the log holds why (a model's error is many lines of JSON in the reply)
            tail = self.log_tail()
            self.stop()
            raise StartFailed("the tts model did not load", tail) from None

    def metrics(self) -> dict[str, float]:
        """voxtriton's samples from the Prometheus endpoint, and Triton's own per-model inference
        counters (`nv_inference_*`): {'name{labels}': value}."""
        url = f"http://{self.local_host}:{self.metrics_port}/metrics"
        with LOCAL.open(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^((?:voxtriton|nv_inference)_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def log_lines(self) -> list[str]:
        try:
            return self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ["(no log)"]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def log_errors(self, limit: int = 8, width: int = 240) -> list[str]:
        """The log's errors, each message's first line: what says why a start failed (else its last lines)."""
        errors = []
        for line in self.log_lines():
            match = LOG_ERROR.match(line)
            message = match.group(1).strip('" ').split("\\n")[0] if match else line
            if (match or line.startswith("error:")) and message not in errors:
                errors.append(message)
        shown = errors[:limit] if errors else self.log_lines()[-limit:]
        return [line if len(line) <= width else line[: width - 3] + "..." for line in shown]

    def drain(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Let the streams in flight end before a stop: the tts model refuses new requests from now
        on ("server shutting down"). True once it reports none left; False after `timeout`, when
        `give_up()` says so, or if the server has exited or has no drain file."""
        if self.drain_file is None or self.process is None:
            return False
        done = done_marker(self.drain_file)
        done.unlink(missing_ok=True)
        self.drain_file.touch()
        deadline = time.monotonic() + timeout
        while not done.exists():
            if time.monotonic() > deadline or give_up() or self.process.poll() is not None:
                return False
            time.sleep(0.1)
        return True

    def stop(self, grace: float = 20.0, give_up: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM (Triton unloads its models: the Python stubs end and free their shared memory),
        then a kill after `grace` seconds, or as soon as `give_up()` says so; then the codec state
        pool files and Triton's stub regions of model processes killed before they could remove them."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            self.stub_regions |= python_stub_regions(process.pid)
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while process.poll() is None and time.monotonic() < deadline and not give_up():
                time.sleep(0.1)
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # stragglers: stubs of a server that hung
            except ProcessLookupError:
                pass
            process.wait()
            wait_for_group_exit(process.pid, 5.0)  # a killed stub lets go of its files as it exits
            remove_orphans()
            for path in self.stub_regions:
                Path(path).unlink(missing_ok=True)
            self.stub_regions.clear()
        if self.mps is not None:
            self.mps.stop()

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        try:
            return self.start()
        except BaseException:  # __exit__ will not run: nothing of a failed start is left
            self.stop()
            self.cleanup()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def python_stub_regions(group: int) -> set[str]:
    """The paths of the Python backend stubs' shared-memory regions that a process group maps:
    tritonserver maps each one it makes, from before it starts the stub. Triton removes a region as
    it unloads the model; a stub or server killed first leaves it in /dev/shm (a MiB or more each)."""
    regions = set()
    for process in group_members(group):
        try:
            regions.update(STUB_REGION.findall((process / "maps").read_text(errors="replace")))
        except OSError:  # ended meanwhile
            pass
    return regions


def wait_for_group_exit(group: int, timeout: float) -> None:
    """Until no process of the group is running, at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while group_running(group) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_running(group: int) -> bool:
    """Whether a process of the group still runs. One whose every thread has exited, awaiting its
    reaping (which a container's first process may never do), has let go of its files and does not
    count; a process whose main thread has exited while others still tear down has not."""
    for process in group_members(group):
        threads = (_stat_fields(task) for task in process.glob("task/[0-9]*/stat"))
        if any(fields and fields[0] not in ("Z", "X") for fields in threads):
            return True
    return False


def group_members(group: int) -> Iterator[Path]:
    """The /proc directory of each process in the group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and int(fields[2]) == group:
            yield stat.parent


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc stat file after the command name (state, parent, group, ...); none for
    a process or thread that ended meanwhile."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
