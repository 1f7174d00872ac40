"""The codec state pool: codec lanes in other processes advance streams' states in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from voxtriton.models.loader import load_codec
from voxtriton.serving.codec_service import CodecService
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
