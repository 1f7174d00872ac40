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

from ..kernels import programmatic_launch, triton_usable
from ..kernels.sampling import MASK31, MAX_KERNEL_VOCAB, mix, mix_in, sample_reference, sample_triton


def fold_seed(seed: int) -> int:
    """Any 64-bit seed -> 31 bits for the hash (on the host, once per request, in Python integers:
    `mix` is exact in them too, and the engine thread makes no PyTorch call for it)."""
    seed &= (1 << 64) - 1
    folded = 0
    for part in (seed & MASK31, (seed >> 31) & MASK31, seed >> 62):
        folded = mix((folded + part + 0x3C6EF372) & MASK31)
    return folded


def noise_keys(seeds: torch.Tensor, frames: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """One key per draw [B, G], from (seed [B], frame [B, G], codebook group [G]); a token's noise is
    a hash of its draw's key and its index (`voxtriton.kernels.sampling.uniform_noise`). A step makes
    the keys of all the groups it samples at once: a few small tensors, where the noise itself is
    [B, G, vocabulary]."""
    return mix_in(mix_in(mix(seeds)[:, None], frames, 0x27D4EB2F), groups + 1, 0x165667B1)


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors [B] (views into the engine's preallocated buffers)."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = no limit
    top_p: torch.Tensor  # float in (0, 1]
    seeds: torch.Tensor  # int64, already folded to 31 bits

    def __getitem__(self, rows: slice | torch.Tensor) -> RowParams:
        """The parameters of `rows` (views for a slice, copies for row indices)."""
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.seeds[rows])


def sample(logits: torch.Tensor, params: RowParams, keys: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from processed logits [B, V] (penalties already applied), with the
    noise of each row's draw key (keys [B], from `noise_keys`): one Triton kernel on a GPU, its
    reference formula elsewhere (`voxtriton.kernels.sampling`)."""
    if logits.shape[-1] <= MAX_KERNEL_VOCAB and triton_usable(logits.device, "sampling"):
        return sample_triton(
            logits,
            params.temperature,
            params.top_k,
            params.top_p,
            keys,
            pdl=programmatic_launch(logits.device),
        )
    return sample_reference(logits, params.temperature, params.top_k, params.top_p, keys)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over each row's previously generated tokens."""
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)
