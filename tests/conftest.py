"""Shared fixtures: random-weight checkpoints made by our own tool, once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The Triton kernels run in Triton's interpreter where there is no GPU, so their tests run on every
# machine. The switch is read when a kernel is defined, so it is set before voxtriton is imported.
# Servers the tests start inherit it and ignore it: outside the kernel tests, only CUDA tensors take
# the Triton path (`voxtriton.kernels.triton_usable`).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from voxtriton.models.random_checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The `tiny` preset with the official tokenizer files (random weights: it makes noise)."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_base_checkpoint(tmp_path_factory) -> Path:
    """The `tiny-base` preset (voice cloning), random weights."""
    return make_checkpoint("tiny-base", tmp_path_factory.mktemp("tiny-base"), seed=2)


@pytest.fixture(scope="session")
def tiny_checkpoint_no_tokenizer(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny-bytes"), seed=1, tokenizer=False)


def require_or_skip(module: str, why: str):
    """Import an optional peer; skip with the reason, or fail where CI demands the peer."""
    try:
        return __import__(module)
    except Exception as error:  # the reference package can fail at import for many reasons
        if os.environ.get("VOXTRITON_REQUIRE_PARITY"):
            raise
        pytest.skip(f"{why}: cannot import {module} ({error})")
