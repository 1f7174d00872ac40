"""Sampling semantics against transformers' own logits processors, and seeded determinism."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from voxtriton.engine.sampling import RowParams, apply_repetition_penalty, fold_seed, noise_keys, sample
from voxtriton.kernels.sampling import bits_to_uniform, filter_top_k_top_p, uniform_noise


def draw(logits, p, frames, group):
    """One codebook group's draw, with the noise the engine would give it."""
    return sample(logits, p, noise_keys(p.seeds, frames[:, None], torch.tensor([group]))[:, 0])


def params(batch, temperature=0.9, top_k=50, top_p=1.0, seed=7):
    def full(value, dtype):
        return torch.full((batch,), value, dtype=dtype)

    return RowParams(
        full(temperature, torch.float32),
        full(top_k, torch.long),
        full(top_p, torch.float32),
        full(fold_seed(seed), torch.long),
    )


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.8), (10, 0.5), (1, 1.0), (0, 0.05)])
def test_filter_keeps_what_transformers_keeps(top_k, top_p):
    scores = torch.randn(4, 2048, generator=torch.Generator().manual_seed(top_k))
    expected = scores
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = filter_top_k_top_p(scores, torch.full((4,), top_k), torch.full((4,), top_p))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(3, 100)
    history = torch.tensor([[1, 5, 5, 9], [0, 0, 0, 0], [99, 3, 2, 1]])
    seen = torch.zeros(3, 100, dtype=torch.bool).scatter_(1, history, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, torch.full((3,), 1.3)), expected)


def test_noise_is_uniform_and_keyed():
    seeds = torch.tensor([fold_seed(1), fold_seed(2)])
    frames = torch.tensor([[0], [0]])

    def noise(frames, group):
        return uniform_noise(noise_keys(seeds, frames, torch.tensor([group]))[:, 0], 50000)

    u = noise(frames, 0)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    assert torch.equal(u, noise(frames, 0))
    assert not torch.equal(u, noise(frames + 1, 0))
    assert not torch.equal(u, noise(frames, 1))


def test_keys_of_all_groups_at_once_equal_each_group_alone():
    """The engine makes one step's draw keys for 16 groups (each with its own frame) in one pass."""
    seeds = torch.tensor([fold_seed(5), fold_seed(6), fold_seed(7)])
    groups = torch.arange(16)
    frames = torch.tensor([[0], [3], [9]]) + (groups == 0)
    together = noise_keys(seeds, frames, groups)
    assert together.unique().numel() == together.numel()
    for group in range(16):
        alone = noise_keys(seeds, frames[:, group : group + 1], groups[group : group + 1])[:, 0]
        assert torch.equal(together[:, group], alone)
    # A shorter vocabulary's noise is the start of a longer one's.
    assert torch.equal(uniform_noise(together, 3072)[..., :2048], uniform_noise(together, 2048))


def test_noise_stays_strictly_inside_zero_one():
    """A noise value of exactly 1.0 gives +inf Gumbel noise, and inf + -inf = NaN wins an argmax."""
    extremes = torch.tensor([0, 1, 2**8 - 1, 2**30, 2**31 - 256, 2**31 - 2, 2**31 - 1])
    u = bits_to_uniform(extremes)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_masked_tokens_are_never_drawn():
    logits = torch.randn(512, 3072)
    logits[:, 2048:] = float("-inf")  # suppressed, as codebook 0's control ids are
    p = params(512, temperature=1.0, top_k=0)
    p.seeds[:] = torch.arange(512)
    for frame in range(20):
        drawn = draw(logits, p, torch.full((512,), frame), group=0)
        assert drawn.max() < 2048


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).expand(4000, 4)
    p = params(4000, temperature=1.0, top_k=0)
    p.seeds[:] = torch.arange(4000)
    counts = (
        torch.bincount(draw(logits, p, torch.zeros(4000, dtype=torch.long), 0), minlength=4).float() / 4000
    )
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)


def test_same_seed_same_draw_whatever_the_batch():
    logits = torch.randn(5, 2048, generator=torch.Generator().manual_seed(1))
    batch = params(5)
    batch.seeds[:] = torch.tensor([fold_seed(s) for s in (11, 12, 13, 14, 15)])
    frames = torch.tensor([3, 1, 4, 1, 5])
    together = draw(logits, batch, frames, group=2)
    for row in range(5):
        alone = RowParams(
            *(t[row : row + 1] for t in (batch.temperature, batch.top_k, batch.top_p, batch.seeds))
        )
        assert (
            draw(logits[row : row + 1], alone, frames[row : row + 1], group=2).item() == together[row].item()
        )


def test_temperature_zero_is_greedy():
    logits = torch.randn(3, 300)
    assert torch.equal(
        draw(logits, params(3, temperature=0.0), torch.zeros(3, dtype=torch.long), 0), logits.argmax(-1)
    )


def test_fold_seed_uses_all_bits():
    assert len({fold_seed(s) for s in (0, 1, 2**31, 2**40, 2**63, 2**64 - 1)}) == 6
    assert all(0 <= fold_seed(s) < 2**31 for s in (0, -1 % 2**64, 12345))
