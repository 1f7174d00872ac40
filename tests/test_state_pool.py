"""The codec state pool: codec lanes in other processes advance streams' states in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from voxtriton.launch.server import TritonServer
from voxtriton.models.loader import load_codec
from voxtriton.serving import pool_files
from voxtriton.serving.codec_service import CodecService
from voxtriton.serving.pool_files import published_path, remove_orphans
from voxtriton.serving.settings import CodecSettings
from voxtriton.serving.state_pool import CodecStatePool, PrimedStates, attach

ATTACH_FROM_STDIN = (
    "import os, sys; from voxtriton.serving.state_pool import attach; "
    "attach(sys.stdin.buffer.read(), os.getppid())[2] += 7"
)


@pytest.fixture()
def pool():
    pool = CodecStatePool(rows=4, state_size=1000, device="cpu", publish_for=os.getpid())
    yield pool
    pool.close()


def test_another_process_writes_the_rows_in_place(pool):
    subprocess.run([sys.executable, "-c", ATTACH_FROM_STDIN], input=pool.handle, check=True, timeout=120)
    assert pool.tensor[2].eq(7).all() and pool.tensor[[0, 1, 3]].eq(0).all()


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/voxtriton-codec-state-other"])
def test_a_forged_handle_is_refused_before_anything_is_opened(pool, path):
    forged = json.dumps({"rows": 1, "state_size": 1, "kind": "file", "path": path}).encode()
    with pytest.raises(ValueError, match="not this server's codec state pool"):
        attach(forged, os.getpid())
    with pytest.raises(ValueError, match="not this server's codec state pool"):
        attach(b"\x80not json", os.getpid())


def test_nothing_attaches_once_the_pool_is_closed(pool):
    handle = pool.handle
    pool.close()
    with pytest.raises(ValueError, match="published no codec state pool"):
        attach(handle, os.getpid())
    failed = subprocess.run(
        [sys.executable, "-c", ATTACH_FROM_STDIN], input=handle, capture_output=True, timeout=120
    )
    assert failed.returncode != 0 and b"published no codec state pool" in failed.stderr


def test_files_no_live_process_holds_are_removed_and_held_ones_kept(tmp_path, monkeypatch):
    """A pool's owner holds its files while it lives, so only a dead owner's are orphans: one whose
    process ended without closing it loses both files to the next sweep; a live one keeps its own."""
    monkeypatch.setenv("VOXTRITON_CACHE", str(tmp_path / "cache"))
    make_and_leave = (
        "import os; from voxtriton.serving.state_pool import CodecStatePool; "
        "pool = CodecStatePool(rows=1, state_size=8, device='cpu', publish_for=os.getpid()); "
        "print(pool.handle.decode()); os._exit(0)"  # no close(), as a killed process
    )
    left = subprocess.run(
        [sys.executable, "-c", make_and_leave], capture_output=True, check=True, timeout=120
    )
    orphan, orphan_handle = Path(json.loads(left.stdout)["path"]), published_path_of(tmp_path, left)
    live = CodecStatePool(rows=1, state_size=8, device="cpu", publish_for=os.getpid())
    live_files = [Path(json.loads(live.handle)["path"]), published_path(os.getpid())]
    try:
        assert not orphan.exists() and not orphan_handle.exists()  # the new pool swept them
        assert not set(remove_orphans()) & set(live_files)  # the live pool's are held
        assert all(path.exists() for path in live_files)
    finally:
        live.close()
    assert not Path(json.loads(live.handle)["path"]).exists() and not published_path(os.getpid()).exists()


def test_the_sweep_removes_only_unheld_regular_files_under_their_own_name(tmp_path, monkeypatch):
    """Not a FIFO planted under a pool file's name (opening one could block the sweep); not a file
    whose name a newer file took between the sweep's open and its lock (that one is in use); not a
    staging file young enough to be one whose lock is not taken yet, but an old one."""
    monkeypatch.setattr(pool_files, "SHARED_DIR", tmp_path)
    monkeypatch.setenv("VOXTRITON_CACHE", str(tmp_path / "cache"))
    fifo = tmp_path / f"{pool_files.POOL_FILE_PREFIX}fifo"
    os.mkfifo(fifo)
    young, old = (tmp_path / f"{pool_files.STAGING_PREFIX}{age}" for age in ("young", "old"))
    young.write_bytes(b"")
    old.write_bytes(b"")
    os.utime(old, (0, 0))
    assert remove_orphans() == [old] and fifo.exists() and young.exists()

    replaced = tmp_path / f"{pool_files.POOL_FILE_PREFIX}replaced"
    replaced.write_bytes(b"old")
    newer = tmp_path / "newer"
    newer.write_bytes(b"newer")
    flock = pool_files.fcntl.flock

    def replaced_before_the_lock(descriptor, operation):
        if operation & pool_files.fcntl.LOCK_EX and newer.exists():
            os.replace(newer, replaced)  # as a pool made at that moment takes the name
        return flock(descriptor, operation)

    monkeypatch.setattr(pool_files.fcntl, "flock", replaced_before_the_lock)
    assert remove_orphans() == [] and replaced.read_bytes() == b"newer"


def published_path_of(tmp_path: Path, completed: subprocess.CompletedProcess) -> Path:
    """The handle file the process that printed a pool's handle published (the only one left)."""
    [handle] = [path for path in (tmp_path / "cache" / "state-pools").glob("*.json")]
    assert handle.read_bytes().decode() == completed.stdout.decode().strip()
    return handle


@pytest.mark.server  # starts a tritonserver
def test_a_killed_server_leaves_no_shared_memory_behind(tiny_checkpoint, tmp_path, monkeypatch):
    """A server killed with its model processes (nothing unloads, nothing removes its files) leaves
    its pool file in shared memory, its published handle and Triton's region of each model's Python
    stub; stopping it removes them all."""
    monkeypatch.setenv("VOXTRITON_CACHE", str(tmp_path / "cache"))
    server = TritonServer(checkpoint=str(tiny_checkpoint), use_mps=False)
    try:
        server.start()
        published = published_path(server.process.pid)
        pool = json.loads(published.read_bytes())  # on a GPU, device memory: no file but the handle
        files = [published] + ([Path(pool["path"])] if pool["kind"] == "file" else [])
        regions = [Path(path) for path in server.stub_regions]
        assert len(regions) == 3 and all(path.exists() for path in regions)  # tts and both codec lanes
        files += regions
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
        assert all(path.exists() for path in files)
    finally:
        server.stop()
        server.cleanup()
    assert not any(path.exists() for path in files)


def test_chunks_decoded_through_the_pool_equal_one_whole_decode(tiny_checkpoint):
    """Two streams, in rows 3 and 1, decoded chunk by chunk (2, 2, 4, 8 frames) through the pool."""
    service = CodecService(CodecSettings(checkpoint_dir=str(tiny_checkpoint)))
    pool = CodecStatePool(rows=4, state_size=service.state_size, device="cpu")
    try:
        pool.tensor.fill_(3.0)  # a reused row's leftovers: frame 0 must start fresh anyway
        codes = torch.randint(0, 2048, (2, 16, 16), generator=torch.Generator().manual_seed(5))
        slots = torch.tensor([3, 1])
        pieces, start = [], 0
        for size in (2, 2, 4, 8):
            pieces.append(
                service.decode(
                    codes[:, start : start + size].int(), torch.full((2,), start), slots, pool.tensor
                )
            )
            start += size
        whole, _ = load_codec(tiny_checkpoint).decode(
            codes, torch.zeros(2, dtype=torch.long), service.model.new_state(2)
        )
        assert (torch.cat(pieces, dim=1) - whole).abs().max().item() <= 1e-4
        with pytest.raises(ValueError, match="slots must be distinct rows"):
            service.decode(
                codes[:, :2].int(), torch.zeros(2, dtype=torch.long), torch.tensor([1, 1]), pool.tensor
            )
        with pytest.raises(ValueError, match="slots must be distinct rows"):
            service.decode(
                codes[:, :2].int(), torch.zeros(2, dtype=torch.long), torch.tensor([0, 4]), pool.tensor
            )
    finally:
        pool.close()


def test_primed_states_restore_exact_rows_and_drop_the_least_recently_used(pool):
    primed = PrimedStates(pool.tensor, capacity=2)
    for slot, value in enumerate((1.5, 2.5, 3.5)):
        pool.tensor[slot] = torch.arange(1000) * value
    primed.keep(("urgent", "a"), 0)
    primed.keep(("urgent", "b"), 1)
    pool.tensor[0] = -1  # the row moves on; the kept copy does not
    assert primed.restore(("urgent", "a"), 3) and torch.equal(pool.tensor[3], torch.arange(1000) * 1.5)
    primed.keep(("urgent", "c"), 2)  # "b" is now the least recently used
    assert not primed.restore(("urgent", "b"), 3)
    assert not primed.restore(("background", "a"), 3)  # kept per codec lane
    assert primed.restore(("urgent", "c"), 3) and torch.equal(pool.tensor[3], torch.arange(1000) * 3.5)
    none_kept = PrimedStates(pool.tensor, capacity=0)
    none_kept.keep(("urgent", "a"), 0)
    assert not none_kept.restore(("urgent", "a"), 3)
    with pytest.raises(ValueError, match="capacity"):
        PrimedStates(pool.tensor, capacity=-1)
