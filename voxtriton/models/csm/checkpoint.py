"""Write random-weight CSM checkpoints in the official layout (`voxtriton make-checkpoint --preset
csm-tiny | csm-1b`).

`csm-1b` is the configuration of `sesame/csm-1b` as transformers' conversion script writes it (a
Llama 3.2 1B backbone, a 4-layer depth decoder, both with Llama 3 RoPE scaling, and the Mimi codec
of `kyutai/mimi`); `csm-tiny` shrinks every width and depth and keeps token ids, the 32 codebooks
and their vocabulary, and the codec's upsampling (1920 samples a frame at 24 kHz). Tensors have the
official names, shapes and dtype (fp32) in one `model.safetensors`, and the tied codebook table is
stored under both of its names with the same values, as transformers' conversion writes it.

The official tokenizer (Llama 3's, 128k merges) cannot be made here; `tokenizer.json` is a
byte-level BPE in the same format with the same special tokens and post-processor and no merges:
each UTF-8 byte becomes the id of its single-byte token in the Llama 3 vocabulary, so the real
tokenizer decodes our ids to the same text. The weights produce noise, not speech.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..loader import weight_map
from ..random_checkpoint import audio_encoder_shapes, random_tensor
from ..text import BYTE_TOKEN_ID
from .config import load_csm_config
from .loader import CODEC_PREFIX
from .mimi import MimiCodec
from .model import CsmModel

PRESETS = ("csm-tiny", "csm-1b")
TIED = {"backbone_model.embed_tokens.embed_audio_tokens.weight": "depth_decoder.model.embed_tokens.weight"}
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3's special tokens, with the two CSM renames (<|AUDIO|>, <|audio_eos|>); the rest are reserved.
SPECIAL_NAMES = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128002: "<|AUDIO|>",
    128003: "<|audio_eos|>",
    128004: "<|finetune_right_pad_id|>",
    128005: "<|reserved_special_token_2|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}

MIMI = {
    "model_type": "mimi",
    "audio_channels": 1,
    "codebook_dim": 256,
    "codebook_size": 2048,
    "compress": 2,
    "dilation_growth_rate": 2,
    "frame_rate": 12.5,
    "head_dim": 64,
    "hidden_act": "gelu",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "kernel_size": 7,
    "last_kernel_size": 3,
    "layer_scale_initial_scale": 0.01,
    "max_position_embeddings": 8000,
    "norm_eps": 1e-05,
    "num_attention_heads": 8,
    "num_filters": 64,
    "num_hidden_layers": 8,
    "num_key_value_heads": 8,
    "num_quantizers": 32,
    "num_residual_layers": 1,
    "num_semantic_quantizers": 1,
    "pad_mode": "constant",
    "residual_kernel_size": 3,
    "rope_theta": 10000.0,
    "sampling_rate": 24000,
    "sliding_window": 250,
    "trim_right_ratio": 1.0,
    "upsample_groups": 512,
    "upsampling_ratios": [8, 6, 5, 4],
    "use_causal_conv": True,
    "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256,
}

CSM_1B = {
    "architectures": ["CsmForConditionalGeneration"],
    "model_type": "csm",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "audio_eos_token_id": 128003,
    "audio_token_id": 128002,
    "bos_token_id": 128000,
    "codebook_eos_token_id": 0,
    "codebook_pad_token_id": 2050,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_codebooks": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pad_token_id": 128002,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 0.5,
        "low_freq_factor": 0.125,
        "original_max_position_embeddings": 1024,
        "rope_type": "llama3",
    },
    "rope_theta": 500000,
    "text_vocab_size": 128256,
    "tie_codebooks_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 2051,
    "depth_decoder_config": {
        "model_type": "csm_depth_decoder_model",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "backbone_hidden_size": 2048,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 33,
        "mlp_bias": False,
        "num_attention_heads": 8,
        "num_codebooks": 32,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 0.0078125,
            "low_freq_factor": 0.001953125,
            "original_max_position_embeddings": 16,
            "rope_type": "llama3",
        },
        "rope_theta": 500000,
        "use_cache": True,
        "vocab_size": 2051,
    },
    "codec_config": MIMI,
}

TINY_OVERRIDES = {
    "backbone": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "depth": dict(
        backbone_hidden_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    ),
    # A short attention window, so a few frames of a test already slide it.
    "codec": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        num_filters=4,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        upsample_groups=32,
        sliding_window=8,
    ),
}

GENERATION_CONFIG = {
    "_from_model_config": False,
    "depth_decoder_do_sample": True,
    "depth_decoder_temperature": 0.9,
    "depth_decoder_top_k": 50,
    "do_sample": True,
    "max_new_tokens": 125,
    "temperature": 0.9,
    "top_k": 50,
}

PREPROCESSOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "processor_class": "CsmProcessor",
    "return_attention_mask": True,
    "sampling_rate": 24000,
}


def preset_config(preset: str) -> dict:
    """config.json contents for a preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = copy.deepcopy(CSM_1B)
    if preset == "csm-tiny":
        config.update(TINY_OVERRIDES["backbone"])
        config["depth_decoder_config"].update(TINY_OVERRIDES["depth"])
        config["codec_config"].update(TINY_OVERRIDES["codec"])
    return config


def checkpoint_shapes(checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
    """Official tensor names and shapes of model.safetensors."""
    config = load_csm_config(checkpoint_dir)
    with torch.device("meta"):
        model, codec = CsmModel(config), MimiCodec(config.codec)
    shapes = {name: target.shape for name, target in weight_map(model).items()}
    # The codec's encoder side has the layout of Qwen3-TTS's tokenizer encoder (a Mimi encoder).
    codec_config = json.loads((checkpoint_dir / "config.json").read_text())["codec_config"]
    for name, shape in audio_encoder_shapes(codec_config).items():
        shapes[CODEC_PREFIX + name.removeprefix("encoder.")] = shape
    shapes.update({CODEC_PREFIX + name: target.shape for name, target in weight_map(codec).items()})
    return shapes


def tokenizer_files() -> dict[str, dict]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json contents."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    names = {
        i: SPECIAL_NAMES.get(i, f"<|reserved_special_token_{i - 128008}|>") for i in range(128000, 128256)
    }
    vocab = {chr(_BYTE_TO_UNICODE[byte]): index for byte, index in BYTE_TOKEN_ID.items()}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    bos, eos = names[128000], names[128001]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0 {eos}:0",
        pair=f"{bos}:0 $A:0 {eos}:0 {bos}:1 $B:1 {eos}:1",
        special_tokens=[(bos, 128000), (eos, 128001)],
    )
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, name in names.items()
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": bos,
        "clean_up_tokenization_spaces": True,
        "eos_token": eos,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": eos,
        "processor_class": "CsmProcessor",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special = {"bos_token": bos, "eos_token": eos, "pad_token": eos}
    # The special tokens keep their Llama 3 ids, in the vocabulary and as added tokens. They go in
    # after serialising: the tokenizers library warns at length about a vocabulary with a gap.
    tokenizer_json = json.loads(tokenizer.to_str())
    tokenizer_json["model"]["vocab"].update({name: i for i, name in names.items()})
    tokenizer_json["added_tokens"] = [{"id": i, **added[str(i)]} for i in sorted(names)]
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
    }


def _gpt2_byte_to_unicode() -> dict[int, int]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell bytes."""
    printable = [b for b in BYTE_TOKEN_ID if BYTE_TOKEN_ID[b] < 188]
    extra = iter(range(256, 512))
    return {b: b if b in printable else next(extra) for b in sorted(BYTE_TOKEN_ID)}


_BYTE_TO_UNICODE = _gpt2_byte_to_unicode()


def make_csm_checkpoint(preset: str, out_dir: Path, seed: int = 0, tokenizer: bool = True) -> Path:
    """Write a random CSM checkpoint; returns its directory. Existing files there are replaced."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = preset_config(preset)
    files = {"config.json": config, "generation_config.json": GENERATION_CONFIG}
    files["preprocessor_config.json"] = PREPROCESSOR_CONFIG
    if tokenizer:
        files.update(tokenizer_files())
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    layer_scale = config["codec_config"]["layer_scale_initial_scale"]
    tensors = {}
    for name, shape in sorted(checkpoint_shapes(out_dir).items()):
        # Codec tensors draw as Qwen3-TTS's codec does (fan-in scaled); tied tables share values.
        source = TIED.get(name, name).removeprefix(CODEC_PREFIX)
        tensors[name] = random_tensor(source, shape, seed, layer_scale).float().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
