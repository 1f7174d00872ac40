"""What the serving engine needs to know about CSM, in one plain description.

The engine, the codec lanes and the scheduler serve Qwen3-TTS today; a model family gives them the
same facts for another model: the frame clock, the shape of a frame, how a request becomes a prompt,
which request fields the model takes, its sampling defaults and when an utterance ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import RequestError
from ..config import read_json
from .config import CsmConfig, load_csm_config
from .prompt import CsmPromptBuilder, CsmTokenizer


@dataclass(frozen=True)
class SamplingDefaults:
    """Codebook 0 (backbone) and codebooks 1.. (depth decoder); temperature 0 means greedy."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    depth_temperature: float
    depth_top_k: int
    depth_top_p: float
    max_frames: int


@dataclass(frozen=True)
class ModelFamily:
    name: str
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
    end_code: int  # a frame whose codebooks 0..K-2 all equal this ends the utterance
    prompt: CsmPromptBuilder

    def check_fields(self, present: set[str]) -> None:
        """Refuse, naming the field, a request field this model does not take."""
        for name in sorted(present):
            if name in self.refused:
                raise RequestError(name, self.refused[name])

    def is_end(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, K] -> [B] bool: the frame is the end-of-audio frame (transformers' rule)."""
        return (codes[:, :-1] == self.end_code).all(dim=1)


def csm_family(checkpoint_dir: Path, config: CsmConfig | None = None) -> ModelFamily:
    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_csm_config(checkpoint_dir)
    path = checkpoint_dir / "generation_config.json"
    g = read_json(path) if path.is_file() else {}

    def temperature(prefix: str) -> float:
        return float(g.get(prefix + "temperature", 1.0)) if g.get(prefix + "do_sample", False) else 0.0

    sampling = SamplingDefaults(
        temperature=temperature(""),
        top_k=int(g.get("top_k", 50)),
        top_p=float(g.get("top_p", 1.0)),
        repetition_penalty=float(g.get("repetition_penalty", 1.0)),
        depth_temperature=temperature("depth_decoder_"),
        depth_top_k=int(g.get("depth_decoder_top_k", 50)),
        depth_top_p=float(g.get("depth_decoder_top_p", 1.0)),
        max_frames=int(g.get("max_new_tokens", 125)),
    )
    return ModelFamily(
        name="csm",
        sample_rate=config.codec.sample_rate,
        frame_rate=config.frame_rate,
        samples_per_frame=config.samples_per_frame,
        codebooks=config.num_codebooks,
        codec_vocab=config.codec.codebook_size,
        depth_steps=config.num_codebooks - 1,
        max_positions=config.backbone.max_positions,
        predictor_positions=config.num_codebooks,
        sampling=sampling,
        fields={
            "text": "the words to speak (required)",
            "speaker": "speaker id, a non-negative integer (default 0)",
            "seed": "sampling seed",
            "max_frames": f"frames to generate at most (default {sampling.max_frames})",
            "ignore_eos": "keep generating past the end-of-audio frame",
            "temperature": "sampling temperature of every codebook (0 = greedy)",
            "top_k": "top-k of every codebook",
            "top_p": "top-p of every codebook",
            "repetition_penalty": "penalty on repeated codebook-0 codes (default 1.0: none)",
        },
        refused={
            "language": "CSM takes no language; it reads the text as written",
            "instruct": "CSM takes no style instruction; the voice comes from `speaker`",
        },
        end_code=config.codebook_eos_token_id,
        prompt=CsmPromptBuilder(config, CsmTokenizer(checkpoint_dir)),
    )
