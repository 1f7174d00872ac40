"""One kernel per sampling call: temperature, top-k, top-p, the Gumbel draw and greedy rows together.

`voxtriton.engine.sampling.sample`, the reference, is about 20 small PyTorch operations per call,
among them a sort of the whole vocabulary, and a frame step makes 16 calls (codebook 0 and the
predictor's 15 groups). Here one program per row loads the row's logits once (the vocabulary fits
in registers: 2048 or 3072 tokens), sorts them in place, and finds the top-k and nucleus thresholds,
then draws with the caller's Gumbel noise. Same semantics as the reference (transformers' order:
temperature, top-k, top-p; ties at a threshold are kept; masked tokens never win, whatever the
noise). It computes in fp32 with correctly rounded division, so it picks the same tokens except
where a nucleus boundary falls within rounding of the probability mass, which the two compute in
different orders.
"""

from __future__ import annotations

import torch

from . import launch_device, triton

if triton is not None:
    import triton.language as tl


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  gumbel: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; temperature, top_k, top_p [B] (0 = greedy / no limit); gumbel [B, >= V] with unit
    stride along the vocabulary. Returns [B] int64 token ids."""
    batch, vocab = logits.shape
    if logits.stride(-1) != 1 or gumbel.stride(-1) != 1:
        raise ValueError("sample_triton needs unit stride along the vocabulary")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    with launch_device(logits):
        _sample_kernel[(batch,)](logits, logits.stride(0), gumbel, gumbel.stride(0), temperature.contiguous(),
                                 top_k.contiguous(), top_p.contiguous(), out, vocab,
                                 BLOCK=triton.next_power_of_2(vocab), num_warps=8)
    return out


if triton is not None:

    @triton.jit
    def _sample_kernel(logits, logits_row_stride, gumbel, gumbel_row_stride, temperature, top_k, top_p, out, vocab,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        index = tl.arange(0, BLOCK)
        valid = index < vocab
        x = tl.load(logits + row * logits_row_stride + index, mask=valid, other=float("-inf")).to(tl.float32)
        t = tl.load(temperature + row)
        greedy = t <= 0
        scaled = tl.math.div_rn(x, tl.where(greedy, 1.0, t))
        # Top-k: the k-th largest score (padding sorts last, at -inf).
        k = tl.load(top_k + row)
        k = tl.where(k > 0, tl.minimum(k, vocab), vocab)
        ordered = tl.sort(scaled, descending=True)
        kth = tl.max(tl.where(index == k - 1, ordered, float("-inf")), axis=0)
        # Top-p over the top k: a token is dropped when the tokens ranked above it hold top_p of the mass.
        ranked = tl.where(index < k, ordered, float("-inf"))
        weights = tl.exp(ranked - tl.max(ranked, axis=0))
        probs = weights / tl.sum(weights, axis=0)
        mass_above = tl.cumsum(probs, axis=0) - probs
        p = tl.load(top_p + row)
        limit = tl.where(p < 1.0, p, float("inf"))  # top_p 1 keeps everything, whatever the rounding
        drop = (mass_above >= limit) & (index > 0)
        # The lowest score kept in sorted order is the threshold (ties with it are kept).
        kept = tl.min(tl.where(drop, float("inf"), ranked), axis=0)
        finite = (scaled == scaled) & (tl.abs(scaled) != float("inf"))
        keep = finite & (scaled >= kth) & (scaled >= kept)
        noise = tl.load(gumbel + row * gumbel_row_stride + index, mask=valid, other=0.0)
        drawn = tl.argmax(tl.where(keep, scaled + noise, float("-inf")), axis=0)
        best = tl.argmax(x, axis=0)
        tl.store(out + row, tl.where(greedy, best, drawn).to(tl.int64))
