"""Write random-weight Qwen3-TTS checkpoints in the official layout (`voxtriton make-checkpoint`).

Tests and benchmarks run without downloading real weights, on checkpoints made here: the official
config files (verbatim copies in `presets/`), tensors with the official names, shapes and dtypes
(talker bf16, codec fp32), and random values. They load through the same loader as a real
checkpoint. They produce noise, not speech.

Presets: `0.6b` and `1.7b` are the official 12 Hz CustomVoice configurations; `tiny` is the 0.6B
configuration with every width and depth shrunk (TINY_OVERRIDES) so it runs faster than real time
on two CPU cores. Token ids, vocabularies, codebooks and the codec's upsampling are unchanged.
`0.6b-base`, `1.7b-base` and `tiny-base` are the same for the Base (voice cloning) models, whose
checkpoints add the speaker encoder.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from .codec import CodecModel
from .config import load_config, mimi_encoder_fields
from .loader import weight_map
from .speaker_encoder import SpeakerEncoderRoot
from .speech_encoder import SpeechEncoder
from .talker import Qwen3TTSBackbone

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("tiny", "0.6b", "1.7b", "tiny-base", "0.6b-base", "1.7b-base")
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.json", "merges.txt")
COMMON_FILES = ("generation_config.json", "preprocessor_config.json")
SPEECH_TOKENIZER_FILES = ("config.json", "preprocessor_config.json", "configuration.json")

TINY_OVERRIDES = {
    "talker": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        text_hidden_size=32,
    ),
    "talker_mrope_section": [4, 2, 2],
    "predictor": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
    ),
    "codec_decoder": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        latent_dim=64,
        codebook_dim=32,
        decoder_dim=64,
    ),
    "codec_encoder": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_filters=8,
        codebook_dim=16,
        upsample_groups=32,
        vector_quantization_hidden_dimension=16,
    ),
    "speaker_encoder": dict(
        enc_dim=64,
        enc_channels=[32, 32, 32, 32, 96],
        enc_attention_channels=16,
        enc_res2net_scale=4,
        enc_se_channels=16,
    ),
}


def preset_configs(preset: str) -> tuple[dict, dict]:
    """(config.json, speech_tokenizer/config.json) contents for a preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    tiny = preset.startswith("tiny")
    source = preset.replace("tiny", "0.6b")
    config = json.loads((PRESET_DIR / source / "config.json").read_text())
    speech = json.loads((PRESET_DIR / "common" / "speech_tokenizer" / "config.json").read_text())
    if tiny:
        config = copy.deepcopy(config)
        config["tts_model_size"] = "tiny"
        talker = config["talker_config"]
        talker.update(TINY_OVERRIDES["talker"])
        talker["rope_scaling"]["mrope_section"] = TINY_OVERRIDES["talker_mrope_section"]
        talker["code_predictor_config"].update(TINY_OVERRIDES["predictor"])
        speech["decoder_config"].update(TINY_OVERRIDES["codec_decoder"])
        speech["encoder_config"].update(TINY_OVERRIDES["codec_encoder"])
        if "speaker_encoder_config" in config:
            config["speaker_encoder_config"].update(TINY_OVERRIDES["speaker_encoder"])
    return config, speech


def audio_encoder_shapes(encoder: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Mimi encoder with this config object (the speech tokenizer's
    `encoder_config`; CSM's codec has the same encoder), under the `encoder.` prefix."""
    with torch.device("meta"):
        module = SpeechEncoder(mimi_encoder_fields(encoder, "encoder_config"))
    return {name: target.shape for name, target in weight_map(module).items()}


def checkpoint_shapes(checkpoint_dir: Path) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Official tensor names and shapes: (model.safetensors, speech_tokenizer/model.safetensors)."""
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        talker_models = [Qwen3TTSBackbone(config)]
        if config.speaker_encoder is not None:
            talker_models.append(SpeakerEncoderRoot(config.speaker_encoder))
        codec = CodecModel(config.codec)

    def shapes(models) -> dict[str, tuple]:
        return {name: target.shape for model in models for name, target in weight_map(model).items()}

    # The speech tokenizer's audio encoder is in every official checkpoint, Base or not.
    speech = json.loads((checkpoint_dir / "speech_tokenizer" / "config.json").read_text())
    return shapes(talker_models), {**shapes([codec]), **audio_encoder_shapes(speech["encoder_config"])}


def random_tensor(name: str, shape: tuple[int, ...], seed: int, layer_scale: float) -> torch.Tensor:
    """Deterministic per (seed, name), whatever order tensors are made in."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("codebook.initialized"):
        return torch.ones(shape)
    # Small but not zero, as in a trained checkpoint, so that a bias or activation parameter applied
    # in the wrong place (the fused codec kernels move them) changes the output the parity tests see.
    if leaf == "bias":
        return torch.randn(shape, generator=generator) * 0.02
    if leaf in ("alpha", "beta"):  # SnakeBeta's log-scale parameters
        return torch.randn(shape, generator=generator) * 0.2
    if "norm" in name and leaf == "weight" or leaf == "cluster_usage":
        return torch.ones(shape)
    if leaf == "scale":
        return torch.full(shape, layer_scale)
    if leaf == "gamma":
        return torch.full(shape, 0.1)
    if name.startswith(("decoder.", "encoder.", "speaker_encoder.")):
        # Scaled by fan-in (residual branches and the output layer further down), so a random codec
        # makes full-range noise mostly inside [-1, 1] rather than silence or clipping.
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
        std = 0.25 if "embed" in leaf else fan_in**-0.5
        if ".conv2." in name:
            std *= 0.1
        if name == "decoder.decoder.6.conv.weight":
            std *= 1.5
        return torch.randn(shape, generator=generator) * std
    return torch.randn(shape, generator=generator) * 0.02


def _write_tensors(
    shapes: dict[str, tuple],
    directory: Path,
    dtype: torch.dtype,
    seed: int,
    layer_scale: float,
    shard_mb: int | None,
) -> None:
    tensors = {
        name: random_tensor(name, shape, seed, layer_scale).to(dtype).contiguous()
        for name, shape in sorted(shapes.items())
    }
    if not shard_mb:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_index = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        weight_index.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_index}, indent=2)
    )


def make_checkpoint(
    preset: str, out_dir: Path, seed: int = 0, shard_mb: int | None = None, tokenizer: bool = True
) -> Path:
    """Write a random checkpoint; returns its directory. Existing files there are replaced."""
    out_dir = Path(out_dir)
    config, speech = preset_configs(preset)
    (out_dir / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "speech_tokenizer" / "config.json").write_text(json.dumps(speech, indent=2) + "\n")
    common = PRESET_DIR / "common"
    for name in COMMON_FILES + (TOKENIZER_FILES if tokenizer else ()):
        shutil.copyfile(common / name, out_dir / name)
    for name in SPEECH_TOKENIZER_FILES[1:]:
        shutil.copyfile(common / "speech_tokenizer" / name, out_dir / "speech_tokenizer" / name)
    talker_shapes, speech_shapes = checkpoint_shapes(out_dir)
    codec_scale = speech["decoder_config"]["layer_scale_initial_scale"]
    _write_tensors(talker_shapes, out_dir, torch.bfloat16, seed, codec_scale, shard_mb)
    _write_tensors(speech_shapes, out_dir / "speech_tokenizer", torch.float32, seed, codec_scale, None)
    return out_dir
