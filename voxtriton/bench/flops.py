"""Arithmetic per frame of the backbone's frame step and of a codec call, counted on meta tensors."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from voxtriton.engine.model_runner import ModelRunner
from voxtriton.models.codec import CodecModel
from voxtriton.models.talker import Qwen3TTSBackbone


def counted(work) -> int:
    with FlopCounterMode(display=False) as counter:
        work()
    return counter.get_total_flops()


def backbone_flops_per_frame(config, batch: int, span: int) -> float:
    """One frame step of `batch` rows whose attention reads `span` positions, per row."""
    with torch.device("meta"):
        backbone = Qwen3TTSBackbone(config).to(torch.bfloat16)
    runner = ModelRunner(backbone, batch, span, 1)
    return counted(lambda: runner.decode(batch, span)) / batch


def codec_flops_per_frame(config, batch: int, frames: int) -> float:
    """One codec call of `batch` chunks of `frames` frames, per frame."""
    with torch.device("meta"):
        codec = CodecModel(config.codec).to(torch.bfloat16)
    codes = torch.zeros((batch, frames, config.codec.num_quantizers), dtype=torch.long, device="meta")
    start = torch.zeros(batch, dtype=torch.long, device="meta")
    state = codec.new_state(batch, device="meta", dtype=torch.bfloat16)
    return counted(lambda: codec.decode(codes, start, state)) / (batch * frames)
