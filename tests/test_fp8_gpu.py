"""FP8 weights on the GPU (skipped without CUDA, or below compute capability 8.9): the kernel check, CUDA
graphs against eager, and how far greedy codes stay with bf16's on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxtriton.bench import fidelity
from voxtriton.kernels import check_kernels
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import FP8_CAPABILITY, quantize_backbone
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


def test_the_quantisation_kernel_serves():
    assert check_kernels(DEVICE)["fp8_quantize_rows"]


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
