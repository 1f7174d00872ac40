"""CSM configuration, read from the official `config.json` (`CsmForConditionalGeneration`).

Field names are those of the official file: the backbone at the top level, `depth_decoder_config`
and `codec_config` (Mimi) nested. Every value this implementation depends on is checked, so an
unsupported checkpoint fails at load naming the file and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..config import (
    CheckpointError,
    SpeechEncoderConfig,
    TransformerConfig,
    _Fields,
    mimi_encoder_config,
    read_json,
)


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3 frequency scaling of RoPE (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    @staticmethod
    def parse(f: _Fields) -> "Llama3Rope | None":
        if f.data.get("rope_scaling") is None:
            return None
        rope = f.child("rope_scaling")
        rope.equals("rope_type", "llama3")
        return Llama3Rope(
            factor=rope.float("factor"),
            low_freq_factor=rope.float("low_freq_factor"),
            high_freq_factor=rope.float("high_freq_factor"),
            original_max_positions=rope.int("original_max_position_embeddings"),
        )


def _llama(f: _Fields) -> TransformerConfig:
    f.equals("mlp_bias", False, default=False)
    return TransformerConfig.parse(f, qk_norm=False)


@dataclass(frozen=True)
class MimiConfig:
    """The Mimi codec's decoder side (`codec_config`); `CsmConfig.codec_encoder` is its encoder side."""

    transformer: TransformerConfig  # the decoder transformer (LayerNorm, GELU MLP, layer scale)
    hidden_size: int
    num_filters: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    num_residual_layers: int
    compress: int
    codebook_size: int
    codebook_dim: int
    projection_dim: int  # vector_quantization_hidden_dimension
    num_quantizers: int
    num_semantic_quantizers: int
    upsample_groups: int
    layer_scale: float
    norm_eps: float
    sample_rate: int
    frame_rate: float

    @property
    def samples_per_frame(self) -> int:
        return round(self.sample_rate / self.frame_rate)

    @property
    def hop(self) -> int:
        """Samples per decoder-transformer step (the SEANet decoder's total upsampling)."""
        return math.prod(self.upsampling_ratios)

    @staticmethod
    def parse(f: _Fields) -> "MimiConfig":
        f.equals("model_type", "mimi")
        f.equals("audio_channels", 1, default=1)
        f.equals("use_causal_conv", True, default=True)
        f.equals("pad_mode", "constant", default="constant")
        f.equals("trim_right_ratio", 1.0, default=1.0)
        f.equals("use_conv_shortcut", False, default=False)
        f.equals("hidden_act", "gelu", default="gelu")
        f.equals("attention_bias", False, default=False)
        hidden, heads = f.int("hidden_size", default=512), f.int("num_attention_heads", default=8)
        kv_heads = f.int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise f._fail("num_key_value_heads", f"a divisor of num_attention_heads={heads}")
        transformer = TransformerConfig(
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size", default=2048),
            num_layers=f.int("num_hidden_layers", default=8),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=f.int("head_dim", default=hidden // heads),
            rms_norm_eps=f.float("norm_eps", default=1e-5),
            rope_theta=f.float("rope_theta", default=10000.0),
            max_positions=f.int("max_position_embeddings", default=8000),
            qk_norm=False,
            sliding_window=f.int("sliding_window", default=250),
        )
        ratios = tuple(f.int_list("upsampling_ratios")) if "upsampling_ratios" in f.data else (8, 6, 5, 4)
        quantizers = f.int("num_quantizers", default=32)
        semantic = f.int("num_semantic_quantizers", default=1)
        if semantic >= quantizers:
            raise f._fail("num_semantic_quantizers", f"fewer than num_quantizers={quantizers}")
        config = MimiConfig(
            transformer=transformer,
            hidden_size=hidden,
            num_filters=f.int("num_filters", default=64),
            upsampling_ratios=ratios,
            kernel_size=f.int("kernel_size", default=7),
            last_kernel_size=f.int("last_kernel_size", default=3),
            residual_kernel_size=f.int("residual_kernel_size", default=3),
            dilation_growth_rate=f.int("dilation_growth_rate", default=2),
            num_residual_layers=f.int("num_residual_layers", default=1),
            compress=f.int("compress", default=2),
            codebook_size=f.int("codebook_size", default=2048),
            codebook_dim=f.int("codebook_dim", default=256),
            projection_dim=f.int("vector_quantization_hidden_dimension", default=256),
            num_quantizers=quantizers,
            num_semantic_quantizers=semantic,
            upsample_groups=f.int("upsample_groups", default=512),
            layer_scale=f.float("layer_scale_initial_scale", default=0.01),
            norm_eps=f.float("norm_eps", default=1e-5),
            sample_rate=f.int("sampling_rate", default=24000),
            frame_rate=f.float("frame_rate", default=12.5),
        )
        if config.codebook_dim != config.projection_dim:
            raise f._fail("codebook_dim", f"vector_quantization_hidden_dimension = {config.projection_dim}")
        if hidden % config.upsample_groups:
            raise f._fail("upsample_groups", f"a divisor of hidden_size={hidden}")
        # Mimi upsamples frames to the SEANet rate with a stride-2 transposed convolution.
        if config.samples_per_frame != 2 * config.hop:
            raise f._fail("frame_rate", f"sampling_rate / (2 * {config.hop}), half the SEANet frame rate")
        return config


@dataclass(frozen=True)
class CsmConfig:
    backbone: TransformerConfig
    backbone_rope: Llama3Rope | None
    depth: TransformerConfig
    depth_rope: Llama3Rope | None
    codec: MimiConfig
    codec_encoder: SpeechEncoderConfig  # the codec's encoder side: context audio -> codes
    num_codebooks: int
    vocab_size: int  # codebook entries per codebook, with the padding/EOS ids
    text_vocab_size: int
    bos_token_id: int
    audio_token_id: int  # a context turn's audio frame (its embedding is the frame's)
    audio_eos_token_id: int  # the frame after a context turn's audio (all codes codebook_eos_token_id)
    codebook_eos_token_id: int
    codebook_pad_token_id: int

    @property
    def frame_rate(self) -> float:
        return self.codec.frame_rate

    @property
    def samples_per_frame(self) -> int:
        return self.codec.samples_per_frame


def load_csm_config(checkpoint_dir: Path) -> CsmConfig:
    path = Path(checkpoint_dir) / "config.json"
    f = _Fields(path, read_json(path))
    f.equals("model_type", "csm")
    f.equals("tie_codebooks_embeddings", True, default=True)
    codebooks, vocab, text_vocab = f.int("num_codebooks"), f.int("vocab_size"), f.int("text_vocab_size")
    depth_fields = f.child("depth_decoder_config")
    depth_fields.equals("num_codebooks", codebooks)
    depth_fields.equals("vocab_size", vocab)
    backbone = _llama(f)
    depth_fields.equals("backbone_hidden_size", backbone.hidden_size)
    codec = MimiConfig.parse(f.child("codec_config"))
    codec_encoder = mimi_encoder_config(f.child("codec_config"))
    if codec.num_quantizers != codebooks:
        raise f._fail("num_codebooks", f"codec_config.num_quantizers = {codec.num_quantizers}")
    if codec.codebook_size >= vocab:
        raise f._fail("vocab_size", f"more than codec_config.codebook_size = {codec.codebook_size}")
    ids = f.token_ids(("bos_token_id", "audio_token_id", "audio_eos_token_id"), text_vocab, "text_vocab_size")
    return CsmConfig(
        backbone=backbone,
        backbone_rope=Llama3Rope.parse(f),
        depth=_llama(depth_fields),
        depth_rope=Llama3Rope.parse(depth_fields),
        codec=codec,
        codec_encoder=codec_encoder,
        num_codebooks=codebooks,
        vocab_size=vocab,
        text_vocab_size=text_vocab,
        bos_token_id=ids["bos_token_id"],
        audio_token_id=ids["audio_token_id"],
        audio_eos_token_id=ids["audio_eos_token_id"],
        codebook_eos_token_id=f.int("codebook_eos_token_id", minimum=0, default=0),
        codebook_pad_token_id=f.int("codebook_pad_token_id", minimum=0, default=vocab - 1),
    )


__all__ = ["CheckpointError", "CsmConfig", "Llama3Rope", "MimiConfig", "load_csm_config"]
