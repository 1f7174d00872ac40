"""Find tritonserver, and prepare a Python backend whose stub was built for this interpreter."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..serving.settings import cache_dir

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
            raise SystemExit(f"voxtriton: --tritonserver {explicit}: no such file")
        if not os.access(path, os.X_OK):
            raise SystemExit(f"voxtriton: --tritonserver {explicit}: not executable")
        bundle = path.parents[1]
        if (bundle / "python_backend_stubs").is_dir():  # an unpacked nvidia-pytriton wheel
            return _bundle_install(bundle)
        return TritonInstall(path, None)
    if NGC_SERVER.is_file():
        return TritonInstall(NGC_SERVER, None)
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise SystemExit(
            "voxtriton: tritonserver not found: pass --tritonserver PATH, run in the NGC tritonserver "
            "container, or `pip install --no-deps nvidia-pytriton==0.7.0` (see README)"
        )
    return _bundle_install(Path(spec.origin).parent / "tritonserver")


def _bundle_install(bundle: Path) -> TritonInstall:
    """The layout of the nvidia-pytriton wheel: pytriton/tritonserver/{bin,backends,...} and
    nvidia_pytriton.libs beside pytriton."""
    libs = bundle.parents[1] / "nvidia_pytriton.libs"
    return TritonInstall(bundle / "bin" / "tritonserver", _python_backend_dir(bundle), [str(libs)])


def _python_backend_dir(bundle: Path) -> Path:
    """A backend directory whose python backend has the stub built for this interpreter."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(
            f"voxtriton: the bundled tritonserver has no Python backend stub for Python {version}"
        )
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
