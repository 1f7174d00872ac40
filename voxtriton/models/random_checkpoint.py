"""Write random-weight Qwen3-TTS checkpoints in the official layout (`voxtriton make-checkpoint`).

Tests and benchmarks run without downloading real weights, on checkpoints made here: the official
config files (verbatim copies in `presets/`), tensors with the official names, shapes and dtypes
(talker bf16, codec fp32), and random values. They load through the same loader as a real
checkpoint. They produce noise, not speech.

Presets: `0.6b` and `1.7b` are the official 12 Hz CustomVoice configurations; `tiny` is the 0.6B
configuration with every width and depth shrunk (TINY_OVERRIDES) so it runs faster than real time
on two CPU cores. Token ids, vocabularies, codebooks and the codec's upsampling are unchanged.
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
from .config import load_config
from .loader import weight_map
from .talker import Qwen3TTSBackbone

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = ("tiny", "0.6b", "1.7b")
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
}


def preset_configs(preset: str) -> tuple[dict, dict]:
    """(config.json, speech_tokenizer/config.json) contents for a preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = "0.6b" if preset == "tiny" else preset
    config = json.loads((PRESET_DIR / base / "config.json").read_text())
    speech = json.loads((PRESET_DIR / "common" / "speech_tokenizer" / "config.json").read_text())
    if preset == "tiny":
        config = copy.deepcopy(config)
        config["tts_model_size"] = "tiny"
        talker = config["talker_config"]
        talker.update(TINY_OVERRIDES["talker"])
        talker["rope_scaling"]["mrope_section"] = TINY_OVERRIDES["talker_mrope_section"]
        talker["code_predictor_config"].update(TINY_OVERRIDES["predictor"])
        speech["decoder_config"].update(TINY_OVERRIDES["codec_decoder"])
        speech["encoder_config"].update(TINY_OVERRIDES["codec_encoder"])
    return config, speech


def audio_encoder_shapes(encoder: dict) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the tokenizer's audio encoder (a Mimi encoder), which serving never runs.

    Official checkpoints carry it in speech_tokenizer/model.safetensors; we write it so the layout
    is complete and the reference implementation loads our checkpoints unchanged.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    filters, compress = encoder["num_filters"], encoder["compress"]
    hidden, codebook_dim = encoder["hidden_size"], encoder["codebook_dim"]

    def conv(name, out_ch, in_ch, kernel, bias=True):
        shapes[f"{name}.weight"] = (out_ch, in_ch, kernel)
        if bias:
            shapes[f"{name}.bias"] = (out_ch,)

    conv("encoder.encoder.layers.0.conv", filters, encoder["audio_channels"], encoder["kernel_size"])
    index, dim = 1, filters
    for ratio in reversed(encoder["upsampling_ratios"]):
        for _ in range(encoder["num_residual_layers"]):
            conv(
                f"encoder.encoder.layers.{index}.block.1.conv",
                dim // compress,
                dim,
                encoder["residual_kernel_size"],
            )
            conv(f"encoder.encoder.layers.{index}.block.3.conv", dim, dim // compress, 1)
            index += 1
        index += 1  # activation
        conv(f"encoder.encoder.layers.{index}.conv", dim * 2, dim, 2 * ratio)
        index, dim = index + 1, dim * 2
    conv(f"encoder.encoder.layers.{index + 1}.conv", hidden, dim, encoder["last_kernel_size"])
    heads, kv_heads, head_dim = (
        encoder["num_attention_heads"],
        encoder["num_key_value_heads"],
        encoder["head_dim"],
    )
    for layer in range(encoder["num_hidden_layers"]):
        prefix = f"encoder.encoder_transformer.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[prefix + norm + ".weight"] = shapes[prefix + norm + ".bias"] = (hidden,)
        shapes[prefix + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[prefix + "mlp.fc1.weight"] = (encoder["intermediate_size"], hidden)
        shapes[prefix + "mlp.fc2.weight"] = (hidden, encoder["intermediate_size"])
        shapes[prefix + "self_attn_layer_scale.scale"] = shapes[prefix + "mlp_layer_scale.scale"] = (hidden,)
    conv("encoder.downsample.conv", hidden, hidden, 2 * compress, bias=False)
    semantic = encoder["num_semantic_quantizers"]
    projection_dim = encoder["vector_quantization_hidden_dimension"]
    for kind, count in (("semantic", semantic), ("acoustic", encoder["num_quantizers"] - semantic)):
        prefix = f"encoder.quantizer.{kind}_residual_vector_quantizer."
        if projection_dim != hidden:
            conv(prefix + "input_proj", projection_dim, hidden, 1, bias=False)
            conv(prefix + "output_proj", hidden, projection_dim, 1, bias=False)
        for q in range(count):
            shapes[f"{prefix}layers.{q}.codebook.cluster_usage"] = (encoder["codebook_size"],)
            shapes[f"{prefix}layers.{q}.codebook.embed_sum"] = (encoder["codebook_size"], codebook_dim)
            shapes[f"{prefix}layers.{q}.codebook.initialized"] = (1,)
    return shapes


def checkpoint_shapes(checkpoint_dir: Path) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Official tensor names and shapes: (model.safetensors, speech_tokenizer/model.safetensors)."""
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        backbone = Qwen3TTSBackbone(config)
        codec = CodecModel(config.codec)
    talker = {name: target.shape for name, target in weight_map(backbone).items()}
    speech = {name: target.shape for name, target in weight_map(codec).items()}
    encoder = json.loads((checkpoint_dir / "speech_tokenizer" / "config.json").read_text())["encoder_config"]
    speech.update(audio_encoder_shapes(encoder))
    return talker, speech


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
    if name.startswith(("decoder.", "encoder.")):
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
