"""Qwen3-TTS (12 Hz) as a model family: the talker with its 15-step code predictor and the 16-codebook
codec, described for the engine, the codec lanes and the scheduler (`models.family`)."""

from __future__ import annotations

from pathlib import Path

import torch

from .codec import CodecModel
from .config import Qwen3TTSConfig, load_config
from .family import ModelFamily, SamplingDefaults
from .fp8 import quantize_backbone
from .loader import load_backbone, load_codec, load_speaker_encoder, load_speech_encoder
from .text import PromptBuilder, TextTokenizer, languages_of


def qwen3_tts_sampling(generation_config: dict) -> SamplingDefaults:
    """The official generation_config.json's sampling: `do_sample` / `subtalker_dosample` false means
    greedy (temperature 0); absent values take the official wrapper's defaults."""
    g = generation_config

    def temperature(do_sample_key: str, key: str) -> float:
        return float(g.get(key, 0.9)) if g.get(do_sample_key, True) else 0.0

    return SamplingDefaults(
        temperature=temperature("do_sample", "temperature"),
        top_k=int(g.get("top_k", 50)),
        top_p=float(g.get("top_p", 1.0)),
        repetition_penalty=float(g.get("repetition_penalty", 1.05)),
        depth_temperature=temperature("subtalker_dosample", "subtalker_temperature"),
        depth_top_k=int(g.get("subtalker_top_k", 50)),
        depth_top_p=float(g.get("subtalker_top_p", 1.0)),
        max_frames=int(g["max_new_tokens"]) if "max_new_tokens" in g else None,
    )


def qwen3_tts_family(checkpoint_dir: Path, config: Qwen3TTSConfig | None = None) -> ModelFamily:
    from ..engine.model_runner import ModelRunner  # the engine imports models, not the other way

    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_config(checkpoint_dir)
    talker, eos = config.talker, config.talker.codec_eos_id
    languages, speakers = languages_of(config), sorted(talker.speakers)
    sampling = qwen3_tts_sampling(config.generation)
    fields = {
        "text": "the words to speak (required)",
        "language": f"one of {', '.join(languages)} (default auto)",
        "seed": "sampling seed",
        "max_frames": "frames to generate at most",
        "ignore_eos": "keep generating past the end of speech",
        "temperature": "sampling temperature of every codebook (0 = greedy)",
        "top_k": "top-k of every codebook",
        "top_p": "top-p of every codebook",
        "repetition_penalty": f"penalty on repeated codebook-0 codes (default {sampling.repetition_penalty})",
        "start_frames": "input streams: the first chunk's frames at least (scheduler_text_start_frames)",
    }
    if config.model_type == "custom_voice":
        fields["speaker"] = f"one of {', '.join(speakers)}"
    if config.supports_instruct:
        fields["instruct"] = "a style instruction" + (
            " (required: it describes the voice)" if config.model_type == "voice_design" else ""
        )
    if config.clones_voices:
        fields["speaker"] = "a registered voice"
        fields["reference_audio"] = "a recording to clone (WAV or FLAC bytes)"
        fields["reference_text"] = "the recording's transcript (optional)"
    return ModelFamily(
        name="qwen3_tts",
        checkpoint=checkpoint_dir,
        config=config,
        sample_rate=config.codec.sample_rate,
        frame_rate=config.frame_rate,
        samples_per_frame=config.codec.samples_per_frame,
        codebooks=talker.num_code_groups,
        codec_vocab=config.codec.codebook_size,
        depth_steps=talker.num_code_groups - 1,
        max_positions=talker.transformer.max_positions,
        predictor_positions=talker.num_code_groups,
        sampling=sampling,
        fields=fields,
        refused={},  # the request parser names the reason of each refusal (model type, voice)
        end_code=eos,
        is_end=lambda codes: codes[:, 0] == eos,
        build_prompt=lambda: PromptBuilder(config, TextTokenizer(checkpoint_dir)),
        speakers=tuple(speakers),
        languages=tuple(languages),
        input_streaming=True,
        load_voice_encoders=(
            (
                lambda device="cpu": (
                    load_speaker_encoder(checkpoint_dir, config, device),
                    load_speech_encoder(checkpoint_dir, config, device),
                )
            )
            if config.clones_voices
            else None
        ),
        voice_embedding_width=talker.transformer.hidden_size if config.clones_voices else 0,
        load_backbone=lambda device="cpu", dtype=torch.float32: load_backbone(
            checkpoint_dir, config, device=device, dtype=dtype
        ),
        load_codec=lambda device="cpu", dtype=torch.float32: load_codec(
            checkpoint_dir, config, device=device, dtype=dtype
        ),
        build_codec=lambda: CodecModel(config.codec),
        new_runner=ModelRunner,
        quantize_fp8=quantize_backbone,
        fp8_kv_cache=True,
    )
