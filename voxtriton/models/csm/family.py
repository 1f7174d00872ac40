"""CSM as a model family: a Llama backbone with a depth decoder over 32 Mimi codebooks at 12.5 Hz,
described for the engine, the codec lanes and the scheduler (`models.family`). A cloned voice is a
context turn before the text: a recording's Mimi codes and its words (`prompt.CsmPromptBuilder`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import read_json
from ..family import ModelFamily, SamplingDefaults
from .config import CsmConfig, load_csm_config
from .loader import load_csm, load_mimi, load_mimi_encoder
from .mimi import MimiCodec
from .prompt import CsmPromptBuilder, CsmTokenizer

# The speaker ids listed to clients: the two of CSM's official conversation examples. Any
# non-negative id is taken (`prompt.parse_speaker`).
LISTED_SPEAKERS = ("0", "1")


def csm_family(checkpoint_dir: Path, config: CsmConfig | None = None) -> ModelFamily:
    from ...engine.csm_runner import CsmRunner  # the engine imports models, not the other way

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
    end = config.codebook_eos_token_id

    def is_end(codes: torch.Tensor) -> torch.Tensor:
        """transformers' rule: codebooks 0..K-2 all equal the end code (the last one does not count)."""
        return (codes[:, :-1] == end).all(dim=1)

    return ModelFamily(
        name="csm",
        checkpoint=checkpoint_dir,
        config=config,
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
            "speaker": "speaker id, a non-negative integer (default 0), or a registered voice",
            "reference_audio": "a recording (WAV or FLAC bytes) of `speaker`: a context turn before the text",
            "reference_text": "the recording's words (required with reference_audio)",
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
            "start_frames": "CSM reads its text whole: it takes no input stream, whose start this sets",
        },
        end_code=end,
        is_end=is_end,
        build_prompt=lambda: CsmPromptBuilder(config, CsmTokenizer(checkpoint_dir)),
        speakers=LISTED_SPEAKERS,
        languages=(),
        input_streaming=False,
        # A voice is a context turn: the recording's codes and its words.
        load_voice_encoders=lambda device="cpu": (None, load_mimi_encoder(checkpoint_dir, config, device)),
        voice_embedding_width=0,
        load_backbone=lambda device="cpu", dtype=torch.float32: load_csm(
            checkpoint_dir, config, device=device, dtype=dtype
        ),
        load_codec=lambda device="cpu", dtype=torch.float32: load_mimi(
            checkpoint_dir, config, device=device, dtype=dtype
        ),
        build_codec=lambda: MimiCodec(config.codec),
        new_runner=lambda model, *args, **kwargs: CsmRunner(model, is_end, *args, **kwargs),
        quantize_fp8=None,
    )
