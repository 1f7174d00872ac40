"""What `voxtriton serve` checks before it starts anything: each problem is one line, naming the
option or setting at fault, instead of a failed start after Triton loaded its models."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import NoReturn

from ..models.config import CheckpointError
from ..models.families import CHECKPOINT_FILES, load_family, model_type
from ..serving.settings import CodecSettings, TTSSettings
from .repository import CODEC_MODELS, model_configs, read_parameters

# The parser each model of the repository reads its config.pbtxt parameters with.
PARSERS = {"tts": TTSSettings.from_model_config} | dict.fromkeys(
    CODEC_MODELS, CodecSettings.from_model_config
)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a clone without `git lfs pull` holds


def fail(problem: str) -> NoReturn:
    raise SystemExit(f"voxtriton: {problem}")


def check_checkpoint(directory: str) -> None:
    path = Path(directory)
    if not path.exists():
        fail(f"--checkpoint {directory}: no such directory")
    if not path.is_dir():
        fail(f"--checkpoint {directory}: not a directory")
    if not (path / "config.json").is_file():
        fail(f"--checkpoint {directory}: config.json is missing (not a checkpoint in the official layout)")
    try:
        family = model_type(path)  # which family serves it: the layout and the config to check
        for names in CHECKPOINT_FILES[family]:
            if not any((path / name).is_file() for name in names):
                fail(
                    f"--checkpoint {directory}: {' or '.join(names)} is missing "
                    f"(not a {family} checkpoint in the official layout)"
                )
        pointers = [
            str(weights.relative_to(path))
            for weights in sorted(path.rglob("*.safetensors"))
            if weights.stat().st_size < 1024 and weights.read_bytes().startswith(LFS_POINTER)
        ]
        if pointers:
            fail(
                f"--checkpoint {directory}: {', '.join(pointers)}: a Git LFS pointer, not the weights "
                f"(run `git lfs pull` in {directory})"
            )
        load_family(path)
    except CheckpointError as error:
        fail(f"--checkpoint: {error}")


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Each port (option: number, 0 for any free one) can be bound on `host`, and only one option uses it."""
    options: dict[int, str] = {}
    for option, port in ports.items():
        if port == 0:
            continue
        if not 0 < port < 65536:
            fail(f"{option} {port}: not a port number (1-65535)")
        if port in options:
            fail(f"{option} {port}: {options[port]} uses the same port")
        options[port] = option
        try:
            family, kind, protocol, _, address = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as error:
            fail(f"--host {host}: cannot resolve it ({error.strerror})")
        with socket.socket(family, kind, protocol) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    fail(
                        f"{option} {port}: port {port} is already in use on {host or '0.0.0.0'} (another "
                        f"server? stop it, or pass {option} with a free port)"
                    )
                fail(f"{option} {port}: cannot bind {host}:{port} ({error.strerror})")


def check_models(repository: Path, parameters: dict[str, dict[str, str]]) -> None:
    """The repository has models, and every --param names one of them (or "*")."""
    models = model_configs(repository)
    if not models:
        fail(f"--model-repository {repository}: no model directories with a config.pbtxt")
    for model in parameters:
        if model != "*" and model not in models:
            fail(f"--param {model}:...: unknown model {model!r} (models: *, {', '.join(models)})")


def check_settings(repository: Path) -> None:
    """Each model's parameters, as rendered, read by the parser the model itself uses."""
    for model, config in model_configs(repository).items():
        if model in PARSERS:
            try:
                parameters = read_parameters(config.read_text())
                PARSERS[model](
                    {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}
                )
            except ValueError as error:
                fail(f"model {model}: {error}")
