"""FP8 weights and the FP8 KV cache on the GPU (skipped without CUDA, or below compute capability 8.9):
the kernel checks, CUDA graphs against eager, the kernels against the formulas in a model, and how far
greedy codes stay with bf16's on the tiny checkpoint (random weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxtriton.bench import fidelity
from voxtriton.kernels import check_kernels
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import FP8_CAPABILITY, quantize_backbone
from voxtriton.models.layers import StaticKV, causal_mask
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < FP8_CAPABILITY,
        reason="needs a CUDA device of compute capability 8.9 or newer",
    ),
]
DEVICE = torch.device("cuda:0")
FRAMES, PROMPTS = 100, 8


def backbones(checkpoint):
    """(bf16 backbone, the same with FP8 projections, prompt builder)."""
    config = load_config(checkpoint)
    reference = load_backbone(checkpoint, config, device=DEVICE, dtype=torch.bfloat16)
    candidate = load_backbone(checkpoint, config, device=DEVICE, dtype=torch.bfloat16)
    quantize_backbone(candidate, "all")
    return reference, candidate, PromptBuilder(config, TextTokenizer(checkpoint))


def test_the_fp8_kernels_serve():
    usable = check_kernels(DEVICE)
    assert usable["fp8_quantize_rows"] and usable["rotary_fp8"] and usable["decode_attention_fp8"]


def test_fp8_kv_cuda_graphs_give_the_eager_codes(tiny_checkpoint):
    """The FP8 KV cache alone and with FP8 weights: graph replays draw the eager codes."""
    reference, candidate, prompts = backbones(tiny_checkpoint)
    requests = fidelity.greedy_requests(reference, prompts, FRAMES, PROMPTS)
    positions = fidelity.positions_needed(requests, FRAMES)
    for model in (reference, candidate):
        codes = [
            fidelity.decode_frames(
                fidelity.new_runner(model, PROMPTS, positions, graphs, fp8_kv_cache="on"),
                fidelity.greedy_requests(model, prompts, FRAMES, PROMPTS),
                FRAMES,
            )
            for graphs in (False, True)
        ]
        np.testing.assert_array_equal(codes[1], codes[0])


def test_fp8_kv_decode_kernel_matches_the_sdpa_formula_in_the_talker(tiny_checkpoint):
    """One decode step of the talker over an FP8 cache: the kernels (rotary writes, decode attention)
    against the same cache read by SDPA after dequantising, rows at different positions."""
    reference, _, _ = backbones(tiny_checkpoint)
    model = reference.talker.model
    t = reference.config.talker.transformer
    batch, span = 3, 96
    generator = torch.Generator().manual_seed(2)
    shape = (t.num_layers, batch, t.num_kv_heads, span, t.head_dim)
    cache = StaticKV.allocate(shape, DEVICE, torch.bfloat16, fp8=True)
    for entries, scales in ((cache.keys, cache.key_scales), (cache.values, cache.value_scales)):
        entries.copy_((torch.randn(shape, generator=generator) * 200).clamp(-448, 448).to(entries.dtype))
        scales.copy_(torch.rand(shape[:-1], generator=generator) * 0.02)
    positions = torch.tensor([[5], [64], [95]], device=DEVICE)
    x = torch.randn(batch, 1, t.hidden_size, generator=generator).to(DEVICE, torch.bfloat16)
    outputs = []
    with torch.inference_mode():
        for mask in (None, causal_mask(positions, span)):
            copy = StaticKV(
                *(part.clone() for part in (cache.keys, cache.values, cache.key_scales, cache.value_scales))
            )
            outputs.append(model(x, positions, copy.bind(positions, span), mask).float())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=3e-2, atol=3e-2)


def test_fp8_cuda_graphs_give_the_eager_codes(tiny_checkpoint):
    _, candidate, prompts = backbones(tiny_checkpoint)
    requests = fidelity.greedy_requests(candidate, prompts, FRAMES, PROMPTS)
    positions = fidelity.positions_needed(requests, FRAMES)
    codes = [
        fidelity.decode_frames(
            fidelity.new_runner(candidate, PROMPTS, positions, graphs),
            fidelity.greedy_requests(candidate, prompts, FRAMES, PROMPTS),
            FRAMES,
        )
        for graphs in (False, True)
    ]
    np.testing.assert_array_equal(codes[1], codes[0])


def test_fp8_greedy_codes_against_bf16(tiny_checkpoint):
    """Teacher-forced, every codebook's logits stay within FP8 precision of bf16's (asserted). Free
    running, the share of agreeing codes is printed, not asserted: random weights give near-flat
    logits, so one flipped argmax sends a prompt down another path; fp8_check.py measures the 1.7B."""
    reference, candidate, prompts = backbones(tiny_checkpoint)
    requests = fidelity.greedy_requests(reference, prompts, FRAMES, PROMPTS)
    positions = fidelity.positions_needed(requests, FRAMES)
    report = fidelity.teacher_forced_logit_error(
        fidelity.new_runner(reference, PROMPTS, positions, graphs=False),
        fidelity.new_runner(candidate, PROMPTS, positions, graphs=False),
        requests,
        FRAMES,
    )
    for row in report:
        assert 0 < row["mean_abs_error_rel"] < 0.15, row
    codes = [
        fidelity.decode_frames(
            fidelity.new_runner(model, PROMPTS, positions, graphs=True),
            fidelity.greedy_requests(model, prompts, FRAMES, PROMPTS),
            FRAMES,
        )
        for model in (reference, candidate)
    ]
    agreement = fidelity.code_agreement(*codes)
    print(
        f"tiny checkpoint, {PROMPTS} prompts x {FRAMES} frames: top-1 agreement teacher-forced "
        f"{[round(row['top1_agreement'], 3) for row in report]}; free-running codes agree "
        f"{agreement['all_codebooks']:.3f}, first difference per prompt {agreement['first_difference']}"
    )
