"""One kernel per sampling call: temperature, top-k, top-p, the Gumbel draw and greedy rows together,
and `sample_reference`, the same draw in PyTorch.

The reference is about 20 small PyTorch operations per call, among them a sort of the whole
vocabulary, and a frame step makes 16 calls (codebook 0 and the predictor's 15 groups). Here one
program per row loads the row's logits once (the vocabulary fits in registers: 2048 or 3072 tokens),
finds the top-k and nucleus thresholds, then draws with Gumbel noise it makes from the row's draw
key, with the reference's hash: no [rows, vocabulary] noise tensor is made or read. The top-k
threshold is a radix select over the scores' bits (`RADIX_BITS` at a time), not a sort: a sort of
the row (a bitonic network, about 20 us a call at one row on an H100) runs only for rows with a
nucleus (top_p < 1), which need the probabilities in rank order. Same semantics as the reference
(transformers' order: temperature, top-k, top-p; ties at a threshold are kept; masked tokens never
win, whatever the noise). It computes in fp32 with correctly rounded division, so it picks the same
tokens except where a nucleus boundary falls within rounding of the probability mass, which the two
compute in different orders, or where two tokens' noisy scores tie to within the last bit of the
logarithms (the GPU's and PyTorch's need not agree to the bit).
"""

from __future__ import annotations

import torch

from .registry import Comparison, launch_device, launch_options, register_check, triton

if triton is not None:
    import triton.language as tl

    from .registry import await_inputs

# The noise hash's constants (the kernel's `_mix` repeats `mix`).
MASK31 = 0x7FFFFFFF
MIX = 0x045D9F3B  # < 2**27: products of 31-bit values stay inside int64
TOKEN_MULTIPLIER = 0x61C8864F
# A program holds its row's whole vocabulary in registers; larger vocabularies take the reference.
MAX_KERNEL_VOCAB = 8192
# Bits of the k-th largest score the radix select settles per pass over the row: 32 / RADIX_BITS
# passes, each comparing every score with 2**RADIX_BITS candidates.
RADIX_BITS = 2


def mix(x):
    """31-bit integer hash (xorshift-multiply) of a tensor or a Python int, exact in int64 on every
    device (and in the kernel, which repeats it)."""
    x = ((x ^ (x >> 16)) * MIX) & MASK31
    x = ((x ^ (x >> 16)) * MIX) & MASK31
    return x ^ (x >> 16)


def mix_in(key: torch.Tensor, index: torch.Tensor, multiplier: int) -> torch.Tensor:
    """The hash of `key` extended by `index` (spread by an odd multiplier, kept to 27 bits). The
    kernel repeats it for token indices."""
    return mix((key + index * multiplier % (1 << 27)) & MASK31)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """31-bit integers -> floats strictly inside (0, 1).

    23 bits, so k + 0.5 is exact in float32: with 24, the top value rounds to exactly 1.0, whose
    Gumbel noise is +inf, and +inf + (-inf) = NaN would let a masked token win the argmax.
    """
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 23))


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise [..., vocab] for the draws of `keys` [...]: a hash of each draw's key and the
    token's index."""
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return bits_to_uniform(mix_in(keys[..., None], tokens, TOKEN_MULTIPLIER))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [..., vocab] for `sample_reference` (see `uniform_noise`)."""
    return -torch.log(-torch.log(uniform_noise(keys, vocab)))


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


def sample_reference(logits, temperature, top_k, top_p, keys):
    """`sample_triton` in PyTorch (same arguments and result)."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    filtered = filter_top_k_top_p(scaled, top_k, top_p)
    # Masked tokens stay out whatever the noise (and whatever NaN the model might produce).
    noise = gumbel_noise(keys, logits.shape[-1])
    drawn = torch.where(torch.isfinite(filtered), filtered + noise, float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """logits [B, V] with unit stride along the vocabulary; temperature [B] (0: greedy), top_k [B] (0: no
    limit), top_p [B] (1: no limit); keys [B] int64 draw keys. Returns [B] int64 token ids. `pdl`: a
    programmatic dependent launch (`registry.programmatic_launch`)."""
    batch, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_triton needs unit stride along the vocabulary")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    with launch_device(logits):
        _sample_kernel[(batch,)](
            logits,
            logits.stride(0),
            keys,
            keys.stride(0),
            temperature.contiguous(),
            top_k.contiguous(),
            top_p.contiguous(),
            out,
            vocab,
            MASK31=MASK31,
            MIX=MIX,
            TOKEN_MULTIPLIER=TOKEN_MULTIPLIER,
            RADIX_BITS=RADIX_BITS,
            BLOCK=triton.next_power_of_2(vocab),
            num_warps=8,
            **launch_options(pdl),
        )
    return out


@register_check("sampling")
def check_sampling(device: torch.device) -> list[Comparison]:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4)) * 3
    temperature = torch.tensor([0.0, 0.9, 1.3, 0.7])
    top_k = torch.tensor([0, 50, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.8, 1.0])
    keys = torch.tensor([5, 2**31 - 1, 0, 123456789])
    inputs = (logits, temperature, top_k, top_p, keys)
    return [(sample_triton(*(t.to(device) for t in inputs)), sample_reference(*inputs), 0)]


if triton is not None:

    @triton.jit
    def _mix(x, MASK31: tl.constexpr, MIX: tl.constexpr):
        x = ((x ^ (x >> 16)) * MIX) & MASK31
        x = ((x ^ (x >> 16)) * MIX) & MASK31
        return x ^ (x >> 16)

    @triton.jit
    def _kth_largest(scores, k, RADIX_BITS: tl.constexpr):
        """The k-th largest of `scores` (fp32, 1 <= k <= their count), exactly: the scores as integers
        in the same order, then their bits, most significant first, RADIX_BITS per pass."""
        bits = scores.to(tl.int32, bitcast=True)
        # Negative floats order backwards by their magnitude bits: flip those, and signed integer order
        # is float order (-0 just below +0, which compare equal as floats).
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        digits = tl.arange(0, 1 << RADIX_BITS).to(tl.int64)
        # The answer, offset by 2**31 (so unsigned), settled bit by bit: the largest value with at least k
        # scores at or above it.
        found = tl.zeros((1,), tl.int64)
        for step in tl.static_range(32 // RADIX_BITS):
            # This pass settles the bits from 32 - RADIX_BITS * (step + 1) up.
            candidates = (found + (digits << (32 - RADIX_BITS * (step + 1))) - (1 << 31)).to(tl.int32)
            at_or_above = tl.sum((ordered[None, :] >= candidates[:, None]).to(tl.int32), axis=1)
            # Counts fall as the digit grows, and digit 0 always holds k: take the largest that does.
            digit = tl.sum((at_or_above >= k).to(tl.int64), axis=0) - 1
            found += digit << (32 - RADIX_BITS * (step + 1))
        kth = (found - (1 << 31)).to(tl.int32)
        kth = tl.where(kth < 0, kth ^ 0x7FFFFFFF, kth).to(tl.float32, bitcast=True)
        return tl.max(kth, axis=0)

    # Keys and per-row scalars arrive at any offset or stride (admissions sample rows anywhere): not
    # specialising on them keeps one compiled variant, so no compile stalls every stream while serving.
    @triton.jit(
        do_not_specialize=["keys_stride"],
        do_not_specialize_on_alignment=["keys", "temperature", "top_k", "top_p"],
    )
    def _sample_kernel(
        logits,
        logits_row_stride,
        keys,
        keys_stride,
        temperature,
        top_k,
        top_p,
        out,
        vocab,
        MASK31: tl.constexpr,
        MIX: tl.constexpr,
        TOKEN_MULTIPLIER: tl.constexpr,
        RADIX_BITS: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        index = tl.arange(0, BLOCK)
        valid = index < vocab
        x = tl.load(logits + row * logits_row_stride + index, mask=valid, other=float("-inf")).to(tl.float32)
        t = tl.load(temperature + row)
        greedy = t <= 0
        scaled = tl.math.div_rn(x, tl.where(greedy, 1.0, t))
        # Top-k: the k-th largest score (padding ranks last, at -inf).
        k = tl.load(top_k + row)
        k = tl.where(k > 0, tl.minimum(k, vocab), vocab)
        kth = _kth_largest(scaled, k, RADIX_BITS)
        kept = kth  # top_p 1 keeps everything, whatever the rounding
        p = tl.load(top_p + row)
        if p < 1.0:
            # Top-p over the top k: a token is dropped when the tokens ranked above it hold top_p of
            # the mass.
            ordered = tl.sort(scaled, descending=True)
            ranked = tl.where(index < k, ordered, float("-inf"))
            weights = tl.exp(ranked - tl.max(ranked, axis=0))
            probs = weights / tl.sum(weights, axis=0)
            mass_above = tl.cumsum(probs, axis=0) - probs
            drop = (mass_above >= p) & (index > 0)
            # The lowest score kept in sorted order is the threshold (ties with it are kept).
            kept = tl.min(tl.where(drop, float("inf"), ranked), axis=0)
        finite = (scaled == scaled) & (tl.abs(scaled) != float("inf"))
        keep = finite & (scaled >= kth) & (scaled >= kept)
        key = tl.load(keys + row * keys_stride)
        bits = _mix((key + index.to(tl.int64) * TOKEN_MULTIPLIER % (1 << 27)) & MASK31, MASK31, MIX)
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        noise = -tl.log(-tl.log(uniform))
        drawn = tl.argmax(tl.where(keep, scaled + noise, float("-inf")), axis=0)
        best = tl.argmax(x, axis=0)
        tl.store(out + row, tl.where(greedy, best, drawn).to(tl.int64))
