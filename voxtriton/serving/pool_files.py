"""The files a codec state pool leaves in the file system, and their removal once no process owns them.

A pool on the CPU is a file in shared memory (RAM), and every pool publishes its handle in the cache
directory. The `tts` model removes both when it unloads, but a model process killed first (its server
killed, or stopped past its exit timeout) cannot. So the owner holds a shared lock on each file for as
long as it lives (the kernel drops it however the process ends), and `remove_orphans` deletes the files
that no process holds: each new pool does, and `TritonServer.stop` once its server has exited.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from .settings import cache_dir

SHARED_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
POOL_FILE_PREFIX = "voxtriton-codec-state-"


def published_dir() -> Path:
    return cache_dir() / "state-pools"


def published_path(server_pid: int) -> Path:
    """Where the `tts` model of the tritonserver with this pid publishes its pool's handle."""
    return published_dir() / f"{server_pid}.json"


def create_held(final: Path, content: bytes = b"") -> int:
    """Write `final` (replacing it) and hold it: a shared lock, taken before the file gets its name,
    so `remove_orphans` never sees it unheld. Returns the descriptor that holds it (keep it open)."""
    descriptor, staging = tempfile.mkstemp(prefix=".voxtriton-staging-", dir=final.parent)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        os.write(descriptor, content)
        os.replace(staging, final)
    except BaseException:
        os.close(descriptor)
        Path(staging).unlink(missing_ok=True)
        raise
    return descriptor


def new_pool_file() -> tuple[Path, int]:
    """A new, empty, held pool file in shared memory: its path and the descriptor that holds it."""
    descriptor, name = tempfile.mkstemp(prefix=POOL_FILE_PREFIX, dir=SHARED_DIR)
    os.close(descriptor)  # a placeholder that reserves the name; the held file replaces it
    path = Path(name)
    return path, create_held(path)


def remove_orphans() -> list[Path]:
    """Delete the pool files and published handles that no live process holds; the ones removed."""
    removed = []
    for path in [*SHARED_DIR.glob(POOL_FILE_PREFIX + "*"), *published_dir().glob("*.json")]:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
            removed.append(path)
        except OSError:  # held by its owner (BlockingIOError), or removed meanwhile
            continue
        finally:
            os.close(descriptor)
    return removed
