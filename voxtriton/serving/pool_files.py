"""The files a codec state pool leaves in the file system, and their removal once no process owns them.

A pool on the CPU is a file in shared memory (RAM), and every pool publishes its handle in the cache
directory. The `tts` model removes both when it unloads, but a model process killed first (its server
killed, or stopped past its exit timeout) cannot. So the owner holds a shared lock on each file for as
long as it lives (the kernel drops it however the process ends), taken before the file has its name,
and `remove_orphans` deletes the files that no process holds: each new pool does, and
`TritonServer.stop` once its server has exited. The cache directory must be local to the host: a
lock does not tell one host's live files from another's.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import tempfile
import time
from pathlib import Path

from .settings import cache_dir

SHARED_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
POOL_FILE_PREFIX = "voxtriton-codec-state-"
STAGING_PREFIX = ".voxtriton-staging-"
# A staging file is locked just after it is made: one younger than this may not be held yet.
STAGING_GRACE_S = 60.0


def published_dir() -> Path:
    return cache_dir() / "state-pools"


def published_path(server_pid: int) -> Path:
    """Where the `tts` model of the tritonserver with this pid publishes its pool's handle."""
    return published_dir() / f"{server_pid}.json"


def publish_held(final: Path, content: bytes) -> int:
    """Write `final` (replacing it), held from before it has its name. Returns the descriptor that
    holds it: keep it open for as long as the file is in use."""
    descriptor, staging = _held_staging(final.parent, content)
    try:
        os.replace(staging, final)
    except BaseException:
        os.close(descriptor)
        Path(staging).unlink(missing_ok=True)
        raise
    return descriptor


def new_pool_file() -> tuple[Path, int]:
    """A new, empty pool file in shared memory under a name no file had before, held from before it
    has that name: its path and the descriptor that holds it."""
    descriptor, staging = _held_staging(SHARED_DIR, b"")
    try:
        while True:
            path = SHARED_DIR / f"{POOL_FILE_PREFIX}{secrets.token_hex(8)}"
            try:
                os.link(staging, path)
                return path, descriptor
            except FileExistsError:
                continue
    except BaseException:
        os.close(descriptor)
        raise
    finally:
        os.unlink(staging)


def _held_staging(directory: Path, content: bytes) -> tuple[int, str]:
    descriptor, staging = tempfile.mkstemp(prefix=STAGING_PREFIX, dir=directory)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        os.write(descriptor, content)
    except BaseException:
        os.close(descriptor)
        os.unlink(staging)
        raise
    return descriptor, staging


def remove_orphans() -> list[Path]:
    """Delete the pool files, published handles and staging files that no live process holds; the
    ones removed."""
    removed = []
    for directory, pattern in ((SHARED_DIR, f"{POOL_FILE_PREFIX}*"), (published_dir(), "*.json")):
        for path in directory.glob(pattern):
            if _remove_if_unheld(path, 0.0):
                removed.append(path)
        for path in directory.glob(f"{STAGING_PREFIX}*"):
            if _remove_if_unheld(path, STAGING_GRACE_S):
                removed.append(path)
    return removed


def _remove_if_unheld(path: Path, min_age_s: float) -> bool:
    try:  # read-write: an exclusive lock needs it where flock is emulated (NFS)
        descriptor = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, another user's, or a link
        return False
    try:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode) or time.time() - opened.st_mtime < min_age_s:
            return False
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        named = os.lstat(path)
        if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
            return False  # replaced since it was opened: the name is a newer, held file's
        path.unlink()
        return True
    except OSError:  # held by its owner (BlockingIOError), or gone meanwhile
        return False
    finally:
        os.close(descriptor)
