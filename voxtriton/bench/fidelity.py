"""How far a changed backbone (FP8 weights) strays from a reference one (bf16) in greedy decoding.

Two measures over the same prompts and frames:
- teacher-forced logits: both step in lockstep and the candidate's heads are handed the reference's
  logits after theirs are compared, so the candidate always continues from the reference's codes and
  each frame's error is that of one step, not of a diverged history;
- free-running codes: each decodes on its own; per codebook, the share of frames whose code agrees,
  and the first frame at which each prompt's codes differ.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ..engine.model_runner import ModelRunner
from ..engine.request import GenerationParams, Request
from ..models.talker import Qwen3TTSBackbone
from ..models.text import PromptBuilder

TEXTS = (
    "Hello, and welcome to the show.",
    "The quick brown fox jumps over the lazy dog.",
    "Please hold while I transfer your call to the next available agent.",
    "Numbers such as 3.14 and 2026 are read aloud as words.",
    "Why is the sky blue? Light scatters off the air.",
    "A longer sentence, with commas, pauses and a question at the very end, doesn't it?",
    "Short.",
    "Streaming speech starts playing before the whole sentence is generated.",
)
MAX_TEXT_TOKENS = 256


def greedy_requests(
    backbone: Qwen3TTSBackbone, prompts: PromptBuilder, frames: int, count: int
) -> list[Request]:
    """`count` requests over TEXTS (speakers in turn), greedy in both the talker and the predictor."""
    generation = backbone.config.generation
    return [
        Request(
            f"p{i}",
            prompts.build(TEXTS[i % len(TEXTS)], prompts.speakers[i % len(prompts.speakers)]),
            GenerationParams.create(
                generation, frames, temperature=0.0, seed=i, max_frames=frames, ignore_eos=True
            ),
        )
        for i in range(count)
    ]


def positions_needed(requests: list[Request], frames: int) -> int:
    return max(len(r.prompt.text_ids) for r in requests) + frames + 1


def decode_frames(runner: ModelRunner, requests: list[Request], frames: int) -> np.ndarray:
    """Prefill `requests` into rows 0.. and decode `frames` frames: codes [requests, frames, 16]. Every
    step attends over the runner's whole length (one span bucket), as captured."""
    batch = len(requests)
    runner.prefill(requests, 0)
    steps = [runner.decode(batch, runner.max_positions)[:, :-1].to("cpu", copy=True) for _ in range(frames)]
    return torch.stack(steps, dim=1).numpy()


def new_runner(
    backbone: Qwen3TTSBackbone, rows: int, positions: int, graphs: bool, fp8_kv_cache: str = "off"
) -> ModelRunner:
    """A runner of `rows` rows and `positions` positions (`fp8_kv_cache`: which caches are FP8, as the
    setting says); with graphs (GPU), its frame step captured."""
    runner = ModelRunner(backbone, rows, positions, MAX_TEXT_TOKENS, fp8_kv_cache=fp8_kv_cache)
    if graphs:
        runner.capture_graphs([rows], [positions])
    return runner


class HeadTap:
    """Forward hooks on a backbone's logit heads: codebook 0's (group 0) and the predictor's 15."""

    def __init__(self, backbone: Qwen3TTSBackbone):
        talker = backbone.talker
        self.heads = [talker.codec_head, *talker.code_predictor.lm_head]
        self.handles = []

    def attach(self, hook) -> None:
        """hook(group, logits) -> logits or None, for every head call."""
        for group, head in enumerate(self.heads):
            self.handles.append(head.register_forward_hook(lambda m, args, out, g=group: hook(g, out)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class LogitError:
    """Per codebook: the largest and summed absolute logit error, the summed reference magnitude,
    and how often the argmax over the codebook's codes agrees; kept on the device until read."""

    def __init__(self, groups: int, codes: int, device: torch.device):
        self.codes = codes
        # columns: max |error|, max |reference|, sum |error|, sum |reference|, logits, top-1 agreements, rows
        self.totals = torch.zeros(groups, 7, dtype=torch.float64, device=device)

    def add(self, group: int, candidate: torch.Tensor, reference: torch.Tensor) -> None:
        candidate, reference = candidate.double(), reference.double()
        error, magnitude = (candidate - reference).abs(), reference.abs()
        row = self.totals[group]
        row[0] = torch.maximum(row[0], error.max())
        row[1] = torch.maximum(row[1], magnitude.max())
        row[2] += error.sum()
        row[3] += magnitude.sum()
        row[4] += error.numel()
        agree = candidate[..., : self.codes].argmax(-1) == reference[..., : self.codes].argmax(-1)
        row[5] += agree.sum()
        row[6] += agree.numel()

    def report(self) -> list[dict]:
        rows = []
        for group, (max_err, max_ref, sum_err, sum_ref, count, agree, calls) in enumerate(
            self.totals.tolist()
        ):
            rows.append(
                {
                    "codebook": group,
                    "max_abs_error": max_err,
                    "max_abs_error_rel": max_err / max_ref,
                    "mean_abs_error": sum_err / count,
                    "mean_abs_error_rel": sum_err / sum_ref,
                    "top1_agreement": agree / calls,
                }
            )
        return rows


@torch.inference_mode()
def teacher_forced_logit_error(
    reference: ModelRunner, candidate: ModelRunner, requests: list[Request], frames: int
) -> list[dict]:
    """Both runners prefill `requests` and decode `frames` frames in lockstep (eagerly: hooks do not
    run in graph replays); every candidate head call is compared with the reference's same call and
    then continues with the reference's logits, so both draw the same codes. Per codebook, see
    `LogitError.report`."""
    config = reference.config
    error = LogitError(config.talker.num_code_groups, config.codec.codebook_size, reference.device)
    calls: deque[tuple[int, torch.Tensor]] = deque()

    def record(group, logits):
        calls.append((group, logits.clone()))

    def compare(group, logits):
        expected_group, expected = calls.popleft()
        assert group == expected_group, "the two models call their heads in different orders"
        error.add(group, logits, expected)
        return expected

    taps = [HeadTap(reference.model), HeadTap(candidate.model)]
    for tap, hook in zip(taps, (record, compare)):
        tap.attach(hook)
    try:
        batch = len(requests)
        for runner in (reference, candidate):
            runner.prefill(requests, 0)
        for _ in range(frames):
            expected = reference.decode(batch, reference.max_positions).clone()
            got = candidate.decode(batch, candidate.max_positions)
            if not torch.equal(expected, got):
                raise RuntimeError("teacher forcing failed: the candidate drew other codes")
    finally:
        for tap in taps:
            tap.detach()
    return error.report()


def code_agreement(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """Codes [prompts, frames, 16] of two free-running decodes: per codebook, the share of (prompt,
    frame) pairs that agree; per prompt, the first frame whose codes differ (frames if none)."""
    same = reference == candidate
    frames = same.shape[1]
    whole_frame = same.all(axis=2)
    first = [int(np.argmin(row)) if not row.all() else frames for row in whole_frame]
    return {
        "per_codebook": same.mean(axis=(0, 1)).tolist(),
        "all_codebooks": float(same.mean()),
        "whole_frames": float(whole_frame.mean()),
        "first_difference": first,
    }
