"""What the engine, the codec lanes and the scheduler know of a model, in one plain description.

A model family is a speech LM that emits frames of codec codes at a fixed clock and a codec that
turns chunks of frames into audio, chunk by chunk with carried state. Its description gives the
frame clock, the shape of a frame, how a request becomes a prompt, which request fields the model
takes, its sampling defaults, when an utterance ends, and how to load its two models and build the
engine's frame runner for it. `families.load_family` picks the family from a checkpoint's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import RequestError


@dataclass(frozen=True)
class SamplingDefaults:
    """Codebook 0 (backbone) and the later codebooks (depth predictor); temperature 0 means greedy."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    depth_temperature: float
    depth_top_k: int
    depth_top_p: float
    max_frames: int | None  # None: as many as the server allows


@dataclass(frozen=True)
class ModelFamily:
    name: str
    checkpoint: Path
    config: Any  # the family's parsed checkpoint config
    sample_rate: int
    frame_rate: float  # frames per second of audio
    samples_per_frame: int
    codebooks: int  # codes per frame
    codec_vocab: int  # codes below this are audio; the rest are the model's specials
    depth_steps: int  # sequential predictor steps per frame after the backbone step
    max_positions: int  # backbone positions: prompt plus frames
    predictor_positions: int  # the predictor's scratch cache per frame
    sampling: SamplingDefaults
    fields: dict[str, str]  # request field -> what it means for this model
    refused: dict[str, str]  # request field -> why this model does not take it
    end_code: int  # the code that marks the end-of-utterance frame (see `is_end`)
    is_end: Callable[[torch.Tensor], torch.Tensor]  # codes [B, K] -> [B] bool: an end frame, not audio
    build_prompt: Callable[[], Any]  # the family's prompt builder (loads the tokenizer): see `prompt`
    speakers: tuple[str, ...]  # the speakers listed for `speaker` (empty: none to list)
    languages: tuple[str, ...]  # what `language` may name (empty: not taken)
    input_streaming: bool  # text may arrive in pieces (Triton sequences)
    # device -> (speaker encoder or None, speech encoder), the encoders of reference recordings; None:
    # the family clones no voice. Without a speaker encoder a voice is a context turn (codes and words).
    load_voice_encoders: Callable[..., tuple[nn.Module | None, nn.Module]] | None
    voice_embedding_width: int  # a voice's x-vector width (0: none)
    load_backbone: Callable[..., nn.Module]  # (device, dtype) -> the backbone with its weights
    load_codec: Callable[..., nn.Module]  # (device, dtype) -> the codec decoder with its weights
    build_codec: Callable[[], nn.Module]  # the codec decoder without weights (shapes, state size)
    new_runner: Callable[..., Any]  # (backbone, max_rows, max_positions, max_text_tokens, prefill_stream)
    # (backbone, fp8_weights scope) -> projections swapped to FP8 in place; None: the family has no FP8 path
    quantize_fp8: Callable[[nn.Module, str], int] | None
    fp8_kv_cache: bool = False  # new_runner takes fp8_kv_cache (an `fp8_kv_cache` value other than off)

    def check_fields(self, present: set[str]) -> None:
        """Refuse, naming the field, a request field this model does not take."""
        for name in sorted(present):
            if name in self.refused:
                raise RequestError(name, self.refused[name])

    @cached_property
    def prompt(self):
        """The prompt builder, made on first use: listings and codec processes never load a tokenizer."""
        return self.build_prompt()

    @property
    def clones_voices(self) -> bool:
        """Takes reference recordings and registered voices."""
        return self.load_voice_encoders is not None

    @property
    def frame_seconds(self) -> float:
        return self.samples_per_frame / self.sample_rate

    def codec_state_size(self) -> int:
        """Values in one stream's packed codec state (what the state pool holds per stream)."""
        with torch.device("meta"):
            return self.build_codec().state_size

    def describe(self) -> dict:
        """What the loaded model offers, for listings (JSON-ready)."""
        return {
            "family": self.name,
            "sample_rate": self.sample_rate,
            "frame_rate": self.frame_rate,
            "codebooks": self.codebooks,
            "speakers": list(self.speakers),
            "languages": list(self.languages),
            "input_streaming": self.input_streaming,
            "clones_voices": self.clones_voices,
            "fields": dict(self.fields),
            "refused": dict(self.refused),
            "max_frames": self.sampling.max_frames,
        }
