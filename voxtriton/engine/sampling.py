"""Batched, seedable sampling with per-request parameters.

Each row of a batch carries its own temperature, top-k, top-p and seed. Randomness is counter
based: the noise for (seed, frame, codebook, token) is a fixed integer hash of those four numbers,
turned into Gumbel noise, so a request draws the same codes whatever batch it shares, with no
generator state to carry and no host synchronisation (the whole step can live in a CUDA graph).
Across devices the hash is exact; the logarithms that turn it into Gumbel noise may differ in the
last bit, which changes a draw only where two tokens' noisy scores tie to within it.

Processing order follows the official generation (transformers' logits processors): repetition
penalty, minimum length / suppressed tokens, then temperature, top-k, top-p. Temperature 0 means
greedy decoding (argmax after the penalties, as `do_sample=False` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import triton_usable
from ..kernels.sampling import MASK31, MAX_KERNEL_VOCAB, MIX, TOKEN_MULTIPLIER, sample_triton


def _mix(x: torch.Tensor) -> torch.Tensor:
    """31-bit integer hash (xorshift-multiply), exact in int64 on every device (and in the sampling
    kernel, which repeats it)."""
    x = ((x ^ (x >> 16)) * MIX) & MASK31
    x = ((x ^ (x >> 16)) * MIX) & MASK31
    return x ^ (x >> 16)


def _mix_in(key: torch.Tensor, index: torch.Tensor, multiplier: int) -> torch.Tensor:
    """The hash of `key` extended by `index` (spread by an odd multiplier, kept to 27 bits). The
    sampling kernel repeats it for token indices."""
    return _mix((key + index * multiplier % (1 << 27)) & MASK31)


def fold_seed(seed: int) -> int:
    """Any 64-bit seed -> 31 bits for the hash (on the host, once per request, in Python integers:
    `_mix` is exact in them too, and the engine thread makes no PyTorch call for it)."""
    seed &= (1 << 64) - 1
    folded = 0
    for part in (seed & MASK31, (seed >> 31) & MASK31, seed >> 62):
        folded = _mix((folded + part + 0x3C6EF372) & MASK31)
    return folded


def noise_keys(seeds: torch.Tensor, frames: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """One key per draw [B, G], from (seed [B], frame [B, G], codebook group [G]); a token's noise is
    a hash of its draw's key and its index (`uniform_noise`). A step makes the keys of all the
    groups it samples at once: a few small tensors, where the noise itself is [B, G, vocabulary]."""
    return _mix_in(_mix_in(_mix(seeds)[:, None], frames, 0x27D4EB2F), groups + 1, 0x165667B1)


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise [..., vocab] for the draws of `keys` [...]."""
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return bits_to_uniform(_mix_in(keys[..., None], tokens, TOKEN_MULTIPLIER))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [..., vocab] for `sample` (see `uniform_noise`)."""
    return -torch.log(-torch.log(uniform_noise(keys, vocab)))


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


def sample(logits: torch.Tensor, params: RowParams, keys: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from processed logits [B, V] (penalties already applied), with the
    noise of each row's draw key (keys [B], from `noise_keys`).

    On a GPU this is one Triton kernel (`voxtriton.kernels.sampling`), which makes the noise itself;
    the formulas below are its reference.
    """
    if logits.shape[-1] <= MAX_KERNEL_VOCAB and triton_usable(logits.device, "sampling"):
        return sample_triton(logits, params.temperature, params.top_k, params.top_p, keys)
    logits = logits.float()
    greedy = params.temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
    # Masked tokens stay out whatever the noise (and whatever NaN the model might produce).
    noise = gumbel_noise(keys, logits.shape[-1])
    drawn = torch.where(torch.isfinite(filtered), filtered + noise, float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over each row's previously generated tokens."""
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)
