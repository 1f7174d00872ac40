"""The built wheel serves on its own: installed into a fresh venv, `voxtriton serve` and
`voxtriton-client speak` work from a directory outside the checkout (random weights: noise)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from server_helpers import read_until_ready

from voxtriton.launch.server import free_ports

CHECKOUT = Path(__file__).resolve().parents[1]
# What the build does not need: version control, environments, build outputs, tests, benchmarks.
NOT_BUILT = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks")


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result


def build_wheel(tmp_path: Path) -> Path:
    """The wheel, built from a copy of the source tree (no stale build/ of the checkout in it)."""
    source = tmp_path / "source"
    shutil.copytree(CHECKOUT, source, symlinks=True, ignore=NOT_BUILT)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, source])
    (wheel,) = wheels.glob("voxtriton-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv with the wheel installed and no path to the source tree. Installing the dependencies
    (torch and the rest) from the network would take far too long for a test: a .pth file gives the
    venv the running interpreter's site-packages directories instead, which hold no voxtriton."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    dependencies = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    site = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    (site / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    return venv


@pytest.mark.server
def test_the_wheel_serves_outside_the_checkout(tmp_path):
    venv = fresh_venv(tmp_path, build_wheel(tmp_path))
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VOXTRITON_CACHE"] = str(tmp_path / "cache")
    bin_dir = venv / "bin"

    found = run(
        [
            bin_dir / "python",
            "-c",
            "import voxtriton, voxtriton_client; from voxtriton.launch.repository import REPOSITORY; "
            "print(voxtriton.__file__, voxtriton_client.__file__, REPOSITORY, sep='\\n')",
        ],
        cwd=workdir,
        env=env,
    ).stdout.split()
    assert all(Path(path).is_relative_to(venv) for path in found), found
    repository = Path(found[2])
    assert (repository / "tts" / "config.pbtxt").is_file() and not repository.is_symlink()

    run([bin_dir / "voxtriton", "make-checkpoint", "--preset", "tiny", "checkpoint"], cwd=workdir, env=env)
    grpc, http, metrics = free_ports(3)
    server = subprocess.Popen(
        [bin_dir / "voxtriton", "serve", "--checkpoint", "checkpoint", "--grpc-port", str(grpc)]
        + ["--http-port", str(http), "--metrics-port", str(metrics)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = read_until_ready(server)
        assert any("voxtriton: ready" in line for line in lines), "".join(lines)
        speak = [bin_dir / "voxtriton-client", "speak", "Hi", "--max-frames", "8", "-o", "out.wav"]
        run(speak + ["--server", f"127.0.0.1:{grpc}"], cwd=workdir, env=env, timeout=120)
        with wave.open(str(workdir / "out.wav")) as audio:
            assert (audio.getnchannels(), audio.getframerate()) == (1, 24000)
            assert 0 < audio.getnframes() <= 8 * 1920
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
