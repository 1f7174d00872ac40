"""`voxtriton serve`: its arguments, the checks before the start, and the server run until a signal."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from ..models.families import load_family
from ..scheduler import POLICY_NAMES
from . import preflight
from .repository import REPOSITORY
from .server import StartFailed, TritonServer


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        help="checkpoint directory in the official layout (default: the embedded "
        "tiny RANDOM-weight checkpoint, which produces noise)",
    )
    parser.add_argument(
        "--policy", choices=POLICY_NAMES, help="codec scheduling (default voxserve: docs/architecture.md)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC, streaming (default 8001)")
    parser.add_argument("--http-port", type=int, default=8000, help="Triton HTTP, health (default 8000)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics (default 8002)")
    parser.add_argument(
        "--tritonserver",
        help="path to the tritonserver binary (default: NGC's /opt/tritonserver, else the one in the "
        "nvidia-pytriton wheel)",
    )
    parser.add_argument(
        "--gpu",
        type=int,
        help="pin the server and its MPS daemon to this GPU (one server per "
        "GPU, each on its own ports, behind a proxy such as Envoy: docs/deploy.md)",
    )
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY, help="default: the packaged one")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C, refuse new requests and let the streams in flight end for up to S "
        "seconds before stopping (a second signal ends the wait, a third kills; default 30)",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="set a config.pbtxt parameter, e.g. tts:max_streams=128 (MODEL * for all; "
        "every key: docs/configuration.md)",
    )


def parse_params(items: list[str]) -> dict[str, dict[str, str]]:
    parameters: dict[str, dict[str, str]] = {}
    for item in items:
        model, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        model, key = model.strip(), key.strip()
        if not model or not sep or not eq or not key:
            raise SystemExit(f"voxtriton: --param {item!r}: expected MODEL:KEY=VALUE")
        parameters.setdefault(model, {})[key] = value
    return parameters


def prepare(args: argparse.Namespace) -> TritonServer:
    """The server `args` describe, its repository rendered; any problem found ends the command first."""
    parameters = parse_params(args.param)
    preflight.check_models(args.model_repository, parameters)
    if args.checkpoint:
        preflight.check_checkpoint(args.checkpoint)
    ports = {
        "--grpc-port": args.grpc_port,
        "--http-port": args.http_port,
        "--metrics-port": args.metrics_port,
    }
    preflight.check_ports(args.host, ports)
    try:
        server = TritonServer(
            checkpoint=args.checkpoint,
            policy=args.policy,
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            repository=args.model_repository,
            tritonserver=args.tritonserver,
            parameters=parameters,
            gpu=args.gpu,
        )
    except ValueError as error:  # a value the model repository cannot hold
        preflight.fail(str(error))
    try:
        preflight.check_settings(server.repository)
    except SystemExit:
        server.cleanup()
        raise
    return server


def installed_command(name: str) -> str:
    """A console script as this shell runs it: its name when PATH finds it (an active venv), else its
    path beside this interpreter (`.venv/bin/voxtriton-client` after `make serve`)."""
    beside = Path(sys.executable).parent / name
    if shutil.which(name) or not beside.exists():
        return name
    return os.path.relpath(beside) if beside.is_relative_to(Path.cwd()) else str(beside)


def first_request_hint(checkpoint: str | None, grpc_url: str, parameters: dict[str, dict[str, str]]) -> str:
    """What to try once the server is ready. A model with no speakers of its own (a Base checkpoint)
    speaks only in a cloned voice, so its hint registers one first, where the server reads voices."""
    speak = (
        f'{installed_command("voxtriton-client")} speak "Hello from voxtriton" -o hello.wav '
        f"--max-frames 50 --server {grpc_url}"
    )
    family = load_family(Path(checkpoint)) if checkpoint else None
    if family is None or family.speakers or not family.clones_voices:
        return f"  try: {speak}"
    register = (
        f"{installed_command('voxtriton')} voices add anna --audio REFERENCE.wav "
        f"--checkpoint {shlex.quote(str(checkpoint))}"
    )
    voices_dir = parameters.get("tts", {}).get("voices_dir")
    if voices_dir:
        register += f" --voices-dir {shlex.quote(voices_dir)}"
    return f"  try: {register}\n  then: {speak} --speaker anna"


class StoppedBeforeReady(Exception):
    """A signal came while the server was starting."""


def serve(args: argparse.Namespace) -> int:
    server = prepare(args)
    if not args.checkpoint:
        print(
            "voxtriton: no --checkpoint given: serving the embedded tiny RANDOM-WEIGHT checkpoint. "
            "It produces noise, not speech. Serve real weights with --checkpoint DIR."
        )
    signals, starting = 0, True

    def on_signal(signum, frame):
        nonlocal signals, starting
        signals += 1
        if starting:  # a start takes minutes (warm-ups): a signal ends it, even mid-call; once, so
            starting = False  # the stop that follows is not cut short
            raise StoppedBeforeReady

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal went away
        signal.signal(number, on_signal)
    print(
        "voxtriton: starting tritonserver: loading the models, then warming every lane (seconds on a "
        f"CPU, minutes on a GPU: kernels and CUDA graphs); log: {server.log_file}",
        flush=True,
    )
    try:
        try:
            server.start(timeout=600)
            starting = False
        except StartFailed as error:
            lines = server.log_errors()
            print(
                f"voxtriton: {error.reason}{'; its log says:' if lines else ' (its log is empty)'}",
                file=sys.stderr,
            )
            print("\n".join(f"  {line}" for line in lines), file=sys.stderr)
            return 1
        except OSError as error:  # the binary itself would not run (say, built for another machine)
            print(f"voxtriton: cannot run {server.install.server}: {error.strerror}", file=sys.stderr)
            return 1
        except StoppedBeforeReady:
            print("voxtriton: stopped before it was ready", file=sys.stderr)
            return 1
        print(
            f"voxtriton: ready. gRPC {server.grpc_url}, HTTP {args.host}:{server.http_port}, "
            f"metrics http://{args.host}:{server.metrics_port}/metrics\n"
            f"{first_request_hint(args.checkpoint, server.grpc_url, parse_params(args.param))}\n"
            f"  log: {server.log_file}",
            flush=True,
        )
        while not signals and server.process.poll() is None:
            time.sleep(0.5)
        if not signals:
            print(
                f"voxtriton: tritonserver exited with code {server.process.returncode}; "
                f"log:\n{server.log_tail()}"
            )
            return 1
        print(
            f"voxtriton: stopping: no new requests, up to {args.drain_timeout:g} s for the streams in flight",
            flush=True,
        )
        if server.drain(args.drain_timeout, give_up=lambda: signals > 1):
            print("voxtriton: every stream has ended", flush=True)
        elif server.process.poll() is not None:
            print(f"voxtriton: tritonserver exited with code {server.process.returncode} while draining")
            return 1
        else:
            print("voxtriton: stopping with streams still in flight: they end with an error", flush=True)
        return 0
    finally:
        server.stop(give_up=lambda: signals > 2)  # a third signal: no wait for the models to unload
        server.cleanup()
