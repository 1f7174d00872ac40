"""Batched, seedable sampling with per-request parameters.

Each row of a batch carries its own temperature, top-k, top-p and seed. Randomness is counter
based: the noise for (seed, frame, codebook, token) is a fixed integer hash of those four numbers,
turned into Gumbel noise, so a request draws the same codes whatever batch it shares, on any device,
with no generator state to carry and no host synchronisation (the whole step can live in a CUDA graph).

Processing order follows the official generation (transformers' logits processors): repetition
penalty, minimum length / suppressed tokens, then temperature, top-k, top-p. Temperature 0 means
greedy decoding (argmax after the penalties, as `do_sample=False` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import triton_usable
from ..kernels.sampling import sample_triton

_MASK31 = 0x7FFFFFFF
_MIX = 0x045D9F3B  # < 2**27: products of 31-bit values stay inside int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """31-bit integer hash (xorshift-multiply), exact in int64 on every device."""
    x = ((x ^ (x >> 16)) * _MIX) & _MASK31
    x = ((x ^ (x >> 16)) * _MIX) & _MASK31
    return x ^ (x >> 16)


def fold_seed(seed: int) -> int:
    """Any 64-bit seed -> 31 bits for the hash (on the host, once per request)."""
    seed &= (1 << 64) - 1
    folded = torch.tensor(0)
    for part in (seed & _MASK31, (seed >> 31) & _MASK31, seed >> 62):
        folded = _mix((folded + part + 0x3C6EF372) & _MASK31)
    return int(folded)


def uniform_noise(seeds: torch.Tensor, frames: torch.Tensor, groups: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise [B, G, vocab] keyed by (seed [B], frame [B, G], codebook group [G], token index).

    All the codebook groups a step samples come from one pass: per-group calls cost ~40 small kernels
    each, which was a third of a frame step at batch 1.
    """
    row = _mix((_mix(seeds)[:, None] + frames * 0x27D4EB2F % (1 << 27)) & _MASK31)
    row = _mix((row + (groups + 1) * 0x165667B1 % (1 << 27)) & _MASK31)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0x61C8864F % (1 << 27)
    return bits_to_uniform(_mix((row[:, :, None] + tokens) & _MASK31))


def gumbel_noise(seeds: torch.Tensor, frames: torch.Tensor, groups: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [B, G, vocab] for `sample` (see `uniform_noise`)."""
    return -torch.log(-torch.log(uniform_noise(seeds, frames, groups, vocab)))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """31-bit integers -> floats strictly inside (0, 1).

    23 bits, so k + 0.5 is exact in float32: with 24, the top value rounds to exactly 1.0, whose
    Gumbel noise is +inf, and +inf + (-inf) = NaN would let a masked token win the argmax.
    """
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors [B] (views into the engine's preallocated buffers)."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = no limit
    top_p: torch.Tensor  # float in (0, 1]
    seeds: torch.Tensor  # int64, already folded to 31 bits


def filter_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set scores outside each row's top-k / nucleus to -inf (transformers' semantics)."""
    vocab = scores.shape[-1]
    ordered, _ = scores.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ranks = torch.arange(vocab, device=scores.device)
    ordered = ordered.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already hold top_p of the mass.
    mass_above = probs.cumsum(dim=-1) - probs
    drop = (mass_above >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    # The lowest score kept in sorted order is the threshold (ties with it are kept, like top-k).
    kept = ordered.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    return scores.masked_fill(scores < kept, float("-inf"))


def sample(logits: torch.Tensor, params: RowParams, gumbel: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from processed logits [B, V] (penalties already applied).

    gumbel: [B, >= V] noise from `gumbel_noise` for this row's (seed, frame, group); only the
    first V columns are used, so one noise tensor serves heads of different vocabulary sizes.
    On a GPU this is one Triton kernel (`voxtriton.kernels.sampling`); the formulas below are its
    reference.
    """
    if logits.is_cuda and triton_usable(logits.device):
        return sample_triton(logits, params.temperature, params.top_k, params.top_p, gumbel)
    logits = logits.float()
    greedy = params.temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
    # Masked tokens stay out whatever the noise (and whatever NaN the model might produce).
    drawn = torch.where(torch.isfinite(filtered), filtered + gumbel[:, : logits.shape[-1]], float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over each row's previously generated tokens."""
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)
