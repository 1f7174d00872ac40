"""`voxtriton serve`: find tritonserver, prepare the Python backend, render the model repository,
start CUDA MPS when a GPU is present, run the server, wait until it is ready, stop it all on exit.

`TritonServer` is the same thing as a context manager, used by the tests and benchmarks.
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path

from ..scheduler.policy import BACKGROUND, URGENT, SchedulerConfig
from .settings import cache_dir, codec_graph_shapes, visible_devices

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
NGC_SERVER = Path("/opt/tritonserver/bin/tritonserver")


@dataclass
class TritonInstall:
    server: Path
    backend_dir: Path | None  # None: the server's own (NGC)
    library_path: list[str] = field(default_factory=list)


def find_tritonserver(explicit: str | None = None) -> TritonInstall:
    """--tritonserver, else the NGC container's, else the one bundled in the nvidia-pytriton wheel."""
    if explicit:
        path = Path(explicit).resolve()
        if not path.is_file():
            raise SystemExit(f"--tritonserver {explicit}: no such file")
        bundle = path.parents[1]
        if (bundle / "python_backend_stubs").is_dir():  # an unpacked nvidia-pytriton wheel
            return _bundle_install(bundle)
        return TritonInstall(path, None)
    if NGC_SERVER.is_file():
        return TritonInstall(NGC_SERVER, None)
    try:
        import importlib.util

        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise SystemExit(
            "tritonserver not found: pass --tritonserver PATH, run in the NGC tritonserver "
            "container, or `pip install --no-deps nvidia-pytriton==0.7.0` (see README)"
        )
    return _bundle_install(Path(spec.origin).parent / "tritonserver")


def _bundle_install(bundle: Path) -> TritonInstall:
    """The layout of the nvidia-pytriton wheel: pytriton/tritonserver/{bin,backends,...} + nvidia_pytriton.libs."""
    libs = bundle.parents[1] / "nvidia_pytriton.libs"
    return TritonInstall(bundle / "bin" / "tritonserver", _python_backend_dir(bundle), [str(libs)])


def _python_backend_dir(bundle: Path) -> Path:
    """A backend directory whose python backend has the stub built for this interpreter."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"the bundled tritonserver has no Python backend stub for Python {version}")
    target = cache_dir() / "triton-backends" / version
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (
        bundle / "backends" / "python" / "libtriton_python.so",
        bundle / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        destination = python_dir / source.name
        if not destination.exists() or destination.stat().st_size != source.stat().st_size:
            shutil.copy2(source, destination)
    return target


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace (or append) `parameters { key: KEY value: { string_value: ... } }` in a config.pbtxt."""
    pattern = re.compile(
        r'(parameters\s*\{\s*key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*(")'
    )
    line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    if pattern.search(config_text):
        return pattern.sub(lambda m: m.group(1) + value + m.group(2), config_text)
    return config_text.rstrip("\n") + "\n" + line + "\n"


def render_repository(source: Path, target: Path, overrides: dict[str, dict[str, str]]) -> Path:
    """Copy the model repository, setting parameters per model ("*" applies to every model)."""
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for config in target.glob("*/config.pbtxt"):
        text = config.read_text()
        model = config.parent.name
        for key, value in {**overrides.get("*", {}), **overrides.get(model, {})}.items():
            text = set_parameter(text, key, str(value))
        config.write_text(text)
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pinned_device(gpu: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the gpu-th GPU this process may use."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return str(gpu)
    allowed = visible_devices(inherited)
    if not 0 <= gpu < len(allowed):
        raise SystemExit(
            f"voxtriton: GPU {gpu} is not among the {len(allowed)} that "
            f"CUDA_VISIBLE_DEVICES={inherited!r} allows"
        )
    return allowed[gpu]


def gpu_count() -> int:
    """GPUs the server may use: those nvidia-smi lists, limited to CUDA_VISIBLE_DEVICES when it is set."""
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    present = result.stdout.count("GPU ") if result.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return present if visible is None else min(present, len(visible_devices(visible)))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL this process when the thread that launched it exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class MPSDaemon:
    """The CUDA MPS control daemon, with private pipe and log directories, for one server run."""

    def __init__(self, root: Path, pinned: dict[str, str] | None = None):
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(root / "mps-pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "mps-log"),
        }
        self.pinned = pinned or {}  # CUDA_VISIBLE_DEVICES of a server pinned to one GPU
        self.started = False

    def start(self) -> None:
        if shutil.which("nvidia-cuda-mps-control") is None:
            print(
                "voxtriton: nvidia-cuda-mps-control not found; codec lanes will time-slice with the backbone"
            )
            return
        for path in self.env.values():
            Path(path).mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            ["nvidia-cuda-mps-control", "-d"],
            env={**os.environ, **self.env, **self.pinned},
            capture_output=True,
        )
        self.started = result.returncode == 0
        if not self.started:
            print(
                f"voxtriton: could not start CUDA MPS ({result.stderr.decode().strip()}); lanes will time-slice"
            )

    def stop(self) -> None:
        if self.started:
            subprocess.run(
                ["nvidia-cuda-mps-control"],
                input=b"quit\n",
                env={**os.environ, **self.env},
                capture_output=True,
                timeout=30,
            )
            self.started = False


CODEC_MODELS = {"codec_urgent": URGENT, "codec_background": BACKGROUND}  # model: the tts lane it serves


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
        if policy != "disaggregated":  # there the codec lanes get a GPU of their own, no partition
            parameters = align_background_partition(parameters or {})
        parameters = codec_graphs_for_the_scheduler(parameters or {})
        self.install = find_tritonserver(tritonserver)
        self.pinned = {"CUDA_VISIBLE_DEVICES": pinned_device(gpu)} if gpu is not None else {}
        self.host = host
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="voxtriton-"))
        overrides: dict[str, dict[str, str]] = {"*": {}, "tts": {}}
        if checkpoint:
            overrides["*"]["checkpoint_dir"] = str(Path(checkpoint).resolve())
        gpus = 1 if gpu is not None else gpu_count()
        if policy:
            overrides["tts"]["scheduler_policy"] = policy
        if policy == "disaggregated":
            if gpus >= 2:  # the codec lanes get the second GPU to themselves
                for model in CODEC_MODELS:
                    overrides.setdefault(model, {}).update(device="cuda:1", sm_count="0")
            else:
                print(
                    "voxtriton: policy 'disaggregated' needs two GPUs; the codec stays on the backbone's device"
                )
        for model, values in (parameters or {}).items():
            overrides.setdefault(model, {}).update(values)
        self.repository = render_repository(repository, self.workdir / "models", overrides)
        self.log_file = log_file or self.workdir / "tritonserver.log"
        self.mps = (
            MPSDaemon(self.workdir, self.pinned) if (gpus > 0 if use_mps is None else use_mps) else None
        )
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{self.grpc_port}"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # The Python stub derives its sys.path from the first python3 on PATH: make it ours.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # The stub links libpython dynamically: give it this interpreter's (pyenv and venv builds
        # keep theirs outside the system library path, and extension modules need the matching one).
        libdir = sysconfig.get_config_var("LIBDIR")
        library_path = self.install.library_path + ([libdir] if libdir else [])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(library_path + [env.get("LD_LIBRARY_PATH", "")])
        if self.mps is not None:
            env.update(self.mps.env)
        visible = self.pinned.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is not None and self.mps is not None and self.mps.started:
            # The MPS daemon was started with these devices, and an MPS client numbers the GPUs its
            # MPS server sees from 0: passed on unchanged, CUDA_VISIBLE_DEVICES=1 would name a second
            # GPU that the server does not have, and the models would find no GPU (on a two-GPU H200
            # host they fell back to the CPU).
            return env | {
                "CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in range(len(visible_devices(visible))))
            }
        return env | self.pinned

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
            preexec_fn=_die_with_parent,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise RuntimeError(f"tritonserver exited with code {code}; log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return self._load_scheduler(deadline)
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; log:\n{self.log_tail()}")

    def _load_scheduler(self, deadline: float) -> None:
        """Load the tts model once the server is up: its warm-up calls the codec models through BLS,
        which Triton refuses while the server starts; the server is ready again once it is warm."""
        url = f"http://127.0.0.1:{self.http_port}/v2/repository/models/tts/load"
        request = urllib.request.Request(url, data=b"", method="POST")
        try:
            urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())).close()
        except OSError as error:
            detail = error.read().decode(errors="replace") if hasattr(error, "read") else str(error)
            self.stop()
            raise RuntimeError(f"the tts model did not load: {detail}; log:\n{self.log_tail()}") from None

    def metrics(self) -> dict[str, float]:
        """voxtriton's samples from the Prometheus endpoint, and Triton's own per-model inference
        counters (`nv_inference_*`): {'name{labels}': value}."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^((?:voxtriton|nv_inference)_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 20.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # stragglers: stubs of a server that hung
            except ProcessLookupError:
                pass
            process.wait()
        if self.mps is not None:
            self.mps.stop()

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        help="checkpoint directory in the official layout (default: the embedded "
        "tiny RANDOM-weight checkpoint, which produces noise)",
    )
    parser.add_argument("--policy", choices=("voxserve", "concurrent", "serial", "disaggregated"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--tritonserver", help="path to the tritonserver binary")
    parser.add_argument(
        "--gpu",
        type=int,
        help="pin the server and its MPS daemon to this GPU (one server per "
        "GPU, each on its own ports, behind `voxtriton gateway --backend ...`)",
    )
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY)
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="set a config.pbtxt parameter, e.g. tts:max_streams=128 (MODEL * for all)",
    )


def align_background_partition(parameters: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """One setting, two readers: the background lane's size is `codec_background:sm_count` (its green
    context) and `tts:background_sms` (under `backbone_partition=exclusive`, the SMs the backbone
    leaves free). Setting either sets both, so the two partitions are sized from one number (the
    driver may still round each to its SM granularity); setting both differently is refused."""
    lane = parameters.get("codec_background", {}).get("sm_count")
    tts = parameters.get("tts", {}).get("background_sms")
    if lane is not None and tts is not None and lane != tts:
        raise SystemExit(
            f"codec_background:sm_count={lane} and tts:background_sms={tts} must agree "
            "(the background lane's SMs); set one of them"
        )
    if lane is None and tts is None:
        return parameters
    size = lane if lane is not None else tts
    aligned = {model: dict(values) for model, values in parameters.items()}
    aligned.setdefault("codec_background", {})["sm_count"] = size
    aligned.setdefault("tts", {})["background_sms"] = size
    return aligned


def codec_graphs_for_the_scheduler(parameters: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The codecs' graph shapes follow the tts scheduler's chunk schedule and their lane's batch
    limit (`codec_graph_shapes`); their defaults follow the scheduler's defaults. When either is set
    for tts and a codec model's `graph_frame_sizes` / `graph_batch_sizes` is not, capture the shapes
    the setting implies."""
    tts = parameters.get("tts", {})
    keys = {
        "scheduler_chunk_schedule": "graph_frame_sizes",
        "scheduler_max_batch": "graph_batch_sizes",
        "scheduler_background_max_batch": "graph_batch_sizes",
    }
    given = {setting.removeprefix("scheduler_"): tts[setting] for setting in keys if setting in tts}
    if not given:
        return parameters
    try:
        for limit in ("max_batch", "background_max_batch"):
            if limit in given:
                given[limit] = int(given[limit])
        scheduler = SchedulerConfig(**given)
    except ValueError:  # the tts model refuses the setting itself, naming it
        return parameters
    aligned = {model: dict(values) for model, values in parameters.items()}
    for model, lane in CODEC_MODELS.items():
        shapes = codec_graph_shapes(scheduler, lane)
        implied = {key: shapes[key] for setting, key in keys.items() if setting in tts}
        set_for_model = {**parameters.get("*", {}), **parameters.get(model, {})}
        for key, sizes in implied.items():
            if key not in set_for_model:
                aligned.setdefault(model, {})[key] = ",".join(map(str, sizes))
    return aligned


def parse_params(items: list[str]) -> dict[str, dict[str, str]]:
    parameters: dict[str, dict[str, str]] = {}
    for item in items:
        model, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"--param {item!r}: expected MODEL:KEY=VALUE")
        parameters.setdefault(model, {})[key] = value
    return parameters


def serve(args: argparse.Namespace) -> int:
    if not args.checkpoint:
        print(
            "voxtriton: no --checkpoint given: serving the embedded tiny RANDOM-WEIGHT checkpoint. "
            "It produces noise, not speech. Serve real weights with --checkpoint DIR."
        )
    server = TritonServer(
        checkpoint=args.checkpoint,
        policy=args.policy,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        repository=args.model_repository,
        tritonserver=args.tritonserver,
        parameters=parse_params(args.param),
        gpu=args.gpu,
    )
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.start(timeout=600)
        print(
            f"voxtriton: ready. gRPC {server.grpc_url}, HTTP {args.host}:{server.http_port}, "
            f"metrics http://{args.host}:{server.metrics_port}/metrics\n"
            f'  try: voxtriton-client speak "Hello from voxtriton" -o hello.wav --server {server.grpc_url}\n'
            f"  log: {server.log_file}",
            flush=True,
        )
        while not stopping and server.process.poll() is None:
            time.sleep(0.5)
        if not stopping:
            print(
                f"voxtriton: tritonserver exited with code {server.process.returncode}; log:\n{server.log_tail()}"
            )
            return 1
        return 0
    finally:
        server.stop()
        server.cleanup()
