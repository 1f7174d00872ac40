"""Qwen3-TTS (12 Hz family) configuration, read from the official config files.

Field names are exactly those of the official `config.json` and `speech_tokenizer/config.json`.
Every value this implementation depends on is checked here, so an unsupported checkpoint fails
at load time with a message naming the file, the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("custom_voice", "voice_design", "base")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served: the message names the file and the problem."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        return with_rope_fields(json.loads(path.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None


def with_rope_fields(data):
    """`data` with each `rope_parameters` (how transformers 5 saves a config: a fine-tuned checkpoint)
    also given as the `rope_theta` and `rope_scaling` of the official configs, which the parsers
    read; an object that has either keeps it."""
    if isinstance(data, list):
        return [with_rope_fields(item) for item in data]
    if not isinstance(data, dict):
        return data
    data = {key: with_rope_fields(value) for key, value in data.items()}
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):
        data.setdefault("rope_theta", rope.get("rope_theta"))
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        # Plain RoPE saves only its type; anything more (Llama 3's factors, mRoPE's sections) scales.
        data.setdefault("rope_scaling", scaling if set(scaling) - {"rope_type"} else None)
    return data


class _Fields:
    """Typed access to one JSON object, with errors that name the file and the dotted field."""

    def __init__(self, source: Path, data: Any, prefix: str = ""):
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: {prefix or 'top level'} must be an object")
        self.source, self.data, self.prefix = source, data, prefix

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def _fail(self, key: str, expected: str) -> CheckpointError:
        value = self.data.get(key, "<missing>")
        return CheckpointError(
            f"{self.source}: {self._name(key)} = {value!r} is not supported (expected {expected})"
        )

    def int(self, key: str, minimum: int = 1, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"an integer >= {minimum}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise self._fail(key, "a positive number")
        return float(value)

    def equals(self, key: str, *allowed: Any, default: Any = None) -> Any:
        value = self.data.get(key, default)
        if value not in allowed:
            raise self._fail(key, " or ".join(repr(a) for a in allowed))
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.data.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(v, int) and v > 0 for v in value):
            raise self._fail(key, "a non-empty list of positive integers")
        return value

    def id_map(self, key: str, vocab_size: int) -> dict[str, int]:
        value = self.data.get(key, {})
        if not isinstance(value, dict) or not all(
            isinstance(v, int) and 0 <= v < vocab_size for v in value.values()
        ):
            raise self._fail(key, f"an object of names to token ids below {vocab_size}")
        return {str(k).lower(): v for k, v in value.items()}

    def token_ids(self, keys: tuple[str, ...], vocab_size: int, vocab_name: str) -> dict[str, int]:
        """Each key's token id: an integer below `vocab_size` (called `vocab_name` in errors)."""
        ids = {key: self.int(key, minimum=0) for key in keys}
        for key, value in ids.items():
            if value >= vocab_size:
                raise self._fail(key, f"an id below {vocab_name}={vocab_size}")
        return ids

    def child(self, key: str) -> "_Fields":
        if key not in self.data:
            raise CheckpointError(f"{self.source}: {self._name(key)} is missing")
        return _Fields(self.source, self.data[key], self._name(key))


@dataclass(frozen=True)
class TransformerConfig:
    """A Qwen3-style decoder stack: the talker, the code predictor and the codec's pre-transformer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    qk_norm: bool
    sliding_window: int | None = None

    @staticmethod
    def parse(f: _Fields, qk_norm: bool, sliding_window: int | None = None) -> "TransformerConfig":
        f.equals("hidden_act", "silu")
        f.equals("attention_bias", False, default=False)
        heads, kv_heads = f.int("num_attention_heads"), f.int("num_key_value_heads")
        if heads % kv_heads:
            raise f._fail("num_key_value_heads", f"a divisor of num_attention_heads={heads}")
        hidden = f.int("hidden_size")
        return TransformerConfig(
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size"),
            num_layers=f.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=f.int("head_dim", default=hidden // heads),
            rms_norm_eps=f.float("rms_norm_eps"),
            rope_theta=f.float("rope_theta"),
            max_positions=f.int("max_position_embeddings"),
            qk_norm=qk_norm,
            sliding_window=sliding_window,
        )


@dataclass(frozen=True)
class TalkerConfig:
    transformer: TransformerConfig
    predictor: TransformerConfig
    vocab_size: int  # codec vocabulary of codebook 0, including control ids
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    predictor_vocab_size: int  # codebooks 1..15
    codec_bos_id: int
    codec_eos_id: int
    codec_pad_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    languages: dict[str, int]
    speakers: dict[str, int]
    speaker_dialects: dict[str, str | None]


@dataclass(frozen=True)
class CodecConfig:
    """The 12 Hz codec decoder (speech_tokenizer/config.json, decoder_config)."""

    transformer: TransformerConfig
    latent_dim: int
    codebook_dim: int
    codebook_size: int
    decoder_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    upsample_rates: tuple[int, ...]  # decoder blocks (waveform rate)
    upsampling_ratios: tuple[int, ...]  # latent upsampling before the decoder blocks
    layer_scale: float
    sample_rate: int
    samples_per_frame: int


@dataclass(frozen=True)
class SpeechEncoderConfig:
    """The 12 Hz tokenizer's audio encoder, a Mimi encoder (speech_tokenizer/config.json,
    encoder_config): waveform at `sample_rate` -> `num_codes` codebooks per frame."""

    transformer: TransformerConfig
    num_filters: int
    kernel_size: int
    residual_kernel_size: int
    last_kernel_size: int
    compress: int
    dilation_growth_rate: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    pad_mode: str
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    quantizer_dim: int
    num_codes: int  # codebooks kept (encoder_valid_num_quantizers)
    sample_rate: int
    samples_per_frame: int


def parse_speech_encoder(path: Path) -> SpeechEncoderConfig:
    """The speech tokenizer's encoder, from its config.json."""
    top = _Fields(path, read_json(path))
    samples_per_frame = top.int("encode_downsample_rate")
    encoder = mimi_encoder_config(top.child("encoder_config"), samples_per_frame)
    return dataclasses.replace(
        encoder,
        num_codes=top.int("encoder_valid_num_quantizers", minimum=2, default=encoder.num_quantizers),
        sample_rate=top.equals("input_sample_rate", 24000, default=24000),
    )


def mimi_encoder_config(e: _Fields, samples_per_frame: int | None = None) -> SpeechEncoderConfig:
    """A Mimi encoder from its config object (`encoder_config` here, CSM's `codec_config`): the
    SEANet ratios, then a stride of 2, make `samples_per_frame` (checked when given)."""
    e.equals("hidden_act", "gelu")
    e.equals("use_causal_conv", True)
    e.equals("audio_channels", 1, default=1)
    e.equals("use_conv_shortcut", False, default=False)
    hidden = e.int("hidden_size")
    heads = e.int("num_attention_heads")
    transformer = TransformerConfig(
        hidden_size=hidden,
        intermediate_size=e.int("intermediate_size"),
        num_layers=e.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=e.int("num_key_value_heads"),
        head_dim=e.int("head_dim", default=hidden // heads),
        rms_norm_eps=e.float("norm_eps"),
        rope_theta=e.float("rope_theta"),
        max_positions=e.int("max_position_embeddings"),
        qk_norm=False,
        sliding_window=e.int("sliding_window"),
    )
    ratios = tuple(e.int_list("upsampling_ratios"))
    if samples_per_frame is not None and samples_per_frame != math.prod(ratios) * 2:
        raise CheckpointError(
            f"{e.source}: encode_downsample_rate = {samples_per_frame} is not supported "
            f"(expected {math.prod(ratios) * 2}: the encoder's ratios, then 2)"
        )
    quantizers = e.int("num_quantizers", minimum=2)
    return SpeechEncoderConfig(
        transformer=transformer,
        num_filters=e.int("num_filters"),
        kernel_size=e.int("kernel_size"),
        residual_kernel_size=e.int("residual_kernel_size"),
        last_kernel_size=e.int("last_kernel_size"),
        compress=e.int("compress"),
        dilation_growth_rate=e.int("dilation_growth_rate"),
        num_residual_layers=e.int("num_residual_layers"),
        upsampling_ratios=ratios,
        pad_mode=e.equals("pad_mode", "constant", default="constant"),
        codebook_size=e.int("codebook_size"),
        codebook_dim=e.int("codebook_dim"),
        num_quantizers=quantizers,
        num_semantic_quantizers=e.equals("num_semantic_quantizers", 1, default=1),
        quantizer_dim=e.int("vector_quantization_hidden_dimension"),
        num_codes=quantizers,
        sample_rate=24000,
        samples_per_frame=math.prod(ratios) * 2,
    )


def mimi_encoder_fields(encoder: dict, source: str) -> SpeechEncoderConfig:
    """`mimi_encoder_config` of a plain dict (`source` names it in errors)."""
    return mimi_encoder_config(_Fields(Path(source), encoder))


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The Base model's ECAPA-TDNN speaker encoder (config.json, speaker_encoder_config); fields the
    official files omit take the reference implementation's defaults."""

    mel_dim: int
    enc_dim: int
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int
    sample_rate: int

    @staticmethod
    def parse(f: _Fields, talker_hidden: int) -> "SpeakerEncoderConfig":
        lists = {
            key: f.data.get(key, default)
            for key, default in (
                ("enc_channels", [512, 512, 512, 512, 1536]),
                ("enc_kernel_sizes", [5, 3, 3, 3, 1]),
                ("enc_dilations", [1, 2, 3, 4, 1]),
            )
        }
        for key, value in lists.items():
            if not isinstance(value, list) or len(value) != len(lists["enc_channels"]) or len(value) < 3:
                raise f._fail(key, "a list as long as enc_channels (at least 3)")
            if not all(isinstance(v, int) and v > 0 for v in value):
                raise f._fail(key, "positive integers")
        channels = lists["enc_channels"]
        if channels[-1] != sum(channels[1:-1]):
            raise f._fail("enc_channels", "a last entry equal to the sum of the SE-Res2Net blocks' channels")
        scale = f.int("enc_res2net_scale", default=8)
        if any(c % scale for c in lists["enc_channels"][1:-1]):
            raise f._fail("enc_res2net_scale", "a divisor of the SE-Res2Net blocks' enc_channels")
        enc_dim = f.int("enc_dim")
        if enc_dim != talker_hidden:
            raise f._fail("enc_dim", f"{talker_hidden}, talker_config.hidden_size")
        return SpeakerEncoderConfig(
            mel_dim=f.int("mel_dim", default=128),
            enc_dim=enc_dim,
            enc_channels=tuple(lists["enc_channels"]),
            enc_kernel_sizes=tuple(lists["enc_kernel_sizes"]),
            enc_dilations=tuple(lists["enc_dilations"]),
            enc_attention_channels=f.int("enc_attention_channels", default=128),
            enc_res2net_scale=scale,
            enc_se_channels=f.int("enc_se_channels", default=128),
            sample_rate=f.equals("sample_rate", 24000, default=24000),
        )


@dataclass(frozen=True)
class Qwen3TTSConfig:
    model_type: str  # custom_voice | voice_design | base
    model_size: str  # 0b6 | 1b7 | anything the checkpoint says
    talker: TalkerConfig
    codec: CodecConfig
    im_start_token_id: int
    im_end_token_id: int
    assistant_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    tts_pad_token_id: int
    generation: dict[str, Any]
    speaker_encoder: SpeakerEncoderConfig | None = None  # Base checkpoints only

    @property
    def clones_voices(self) -> bool:
        return self.model_type == "base"

    @property
    def frame_rate(self) -> float:
        return self.codec.sample_rate / self.codec.samples_per_frame

    @property
    def supports_instruct(self) -> bool:
        # The official wrapper drops `instruct` for the 0.6B CustomVoice model; we refuse it instead.
        # Base models take none: their voice comes from the reference audio.
        return self.model_type == "voice_design" or (
            self.model_type == "custom_voice" and self.model_size != "0b6"
        )


def parse_talker(f: _Fields) -> TalkerConfig:
    rope = f.child("rope_scaling")
    rope.equals("rope_type", "default")
    transformer = TransformerConfig.parse(f, qk_norm=True)
    # Qwen3-TTS uses multimodal RoPE with three identical position rows for speech, which is
    # ordinary RoPE; the sections must still cover the rotary half of each head.
    sections = rope.int_list("mrope_section")
    if sum(sections) * 2 != transformer.head_dim:
        raise rope._fail("mrope_section", f"sections summing to head_dim/2 = {transformer.head_dim // 2}")
    if f.data.get("use_sliding_window") or f.data.get("sliding_window") is not None:
        raise f._fail("sliding_window", "null (sliding-window talkers are not supported)")
    p = f.child("code_predictor_config")
    layer_types = p.data.get("layer_types") or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        raise p._fail("layer_types", "only 'full_attention'")
    if p.data.get("use_sliding_window"):
        raise p._fail("use_sliding_window", "false")
    predictor = TransformerConfig.parse(p, qk_norm=True)
    vocab = f.int("vocab_size")
    groups = f.int("num_code_groups", minimum=2)
    if p.int("num_code_groups", minimum=2) != groups:
        raise p._fail("num_code_groups", f"{groups}, as in talker_config")
    languages = f.id_map("codec_language_id", vocab)
    speakers = f.id_map("spk_id", vocab)
    dialects = f.data.get("spk_is_dialect", {})
    speaker_dialects: dict[str, str | None] = {}
    for name in speakers:
        dialect = dialects.get(name, False) if isinstance(dialects, dict) else False
        if dialect and dialect not in languages:
            raise f._fail("spk_is_dialect", f"dialects listed in codec_language_id (speaker {name!r})")
        speaker_dialects[name] = dialect or None
    ids = f.token_ids(
        (
            "codec_bos_id",
            "codec_eos_token_id",
            "codec_pad_id",
            "codec_think_id",
            "codec_nothink_id",
            "codec_think_bos_id",
            "codec_think_eos_id",
        ),
        vocab,
        "vocab_size",
    )
    return TalkerConfig(
        transformer=transformer,
        predictor=predictor,
        vocab_size=vocab,
        text_vocab_size=f.int("text_vocab_size"),
        text_hidden_size=f.int("text_hidden_size"),
        num_code_groups=groups,
        predictor_vocab_size=p.int("vocab_size"),
        codec_bos_id=ids["codec_bos_id"],
        codec_eos_id=ids["codec_eos_token_id"],
        codec_pad_id=ids["codec_pad_id"],
        codec_think_id=ids["codec_think_id"],
        codec_nothink_id=ids["codec_nothink_id"],
        codec_think_bos_id=ids["codec_think_bos_id"],
        codec_think_eos_id=ids["codec_think_eos_id"],
        languages=languages,
        speakers=speakers,
        speaker_dialects=speaker_dialects,
    )


def parse_codec(path: Path) -> CodecConfig:
    top = _Fields(path, read_json(path))
    top.equals("model_type", "qwen3_tts_tokenizer_12hz")
    d = top.child("decoder_config")
    window = d.int("sliding_window")
    transformer = TransformerConfig.parse(d, qk_norm=False, sliding_window=window)
    rates = tuple(d.int_list("upsample_rates"))
    ratios = tuple(d.int_list("upsampling_ratios"))
    samples_per_frame = math.prod(rates) * math.prod(ratios)
    if top.int("decode_upsample_rate") != samples_per_frame:
        raise top._fail(
            "decode_upsample_rate", f"{samples_per_frame}, the product of the decoder's upsampling factors"
        )
    decoder_dim = d.int("decoder_dim")
    if decoder_dim % (2 ** len(rates)):
        raise d._fail("decoder_dim", f"a multiple of {2 ** len(rates)}")
    codebook_dim = d.int("codebook_dim")
    if codebook_dim % 2:
        raise d._fail("codebook_dim", "an even number")
    return CodecConfig(
        transformer=transformer,
        latent_dim=d.int("latent_dim"),
        codebook_dim=codebook_dim,
        codebook_size=d.int("codebook_size"),
        decoder_dim=decoder_dim,
        num_quantizers=d.int("num_quantizers", minimum=2),
        num_semantic_quantizers=d.equals("num_semantic_quantizers", 1, default=1),
        upsample_rates=rates,
        upsampling_ratios=ratios,
        layer_scale=d.float("layer_scale_initial_scale"),
        sample_rate=top.int("output_sample_rate"),
        samples_per_frame=samples_per_frame,
    )


def load_config(checkpoint_dir: Path) -> Qwen3TTSConfig:
    """Read and check config.json, generation_config.json and speech_tokenizer/config.json."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory does not exist")
    path = checkpoint_dir / "config.json"
    top = _Fields(path, read_json(path))
    top.equals("model_type", "qwen3_tts")
    top.equals("tokenizer_type", "qwen3_tts_tokenizer_12hz")
    model_type = top.equals("tts_model_type", *SUPPORTED_MODEL_TYPES)
    talker = parse_talker(top.child("talker_config"))
    codec = parse_codec(checkpoint_dir / "speech_tokenizer" / "config.json")
    if talker.predictor_vocab_size != codec.codebook_size or talker.num_code_groups != codec.num_quantizers:
        raise CheckpointError(
            f"{path}: talker_config.code_predictor_config (vocab {talker.predictor_vocab_size}, "
            f"{talker.num_code_groups} code groups) does not match speech_tokenizer/config.json "
            f"(codebook_size {codec.codebook_size}, num_quantizers {codec.num_quantizers})"
        )
    if codec.codebook_size > talker.vocab_size:
        raise CheckpointError(f"{path}: talker_config.vocab_size is smaller than the codec codebook")
    tokens = top.token_ids(
        (
            "im_start_token_id",
            "im_end_token_id",
            "assistant_token_id",
            "tts_bos_token_id",
            "tts_eos_token_id",
            "tts_pad_token_id",
        ),
        talker.text_vocab_size,
        "talker_config.text_vocab_size",
    )
    generation = read_json(checkpoint_dir / "generation_config.json")
    speaker_encoder = None
    if model_type == "base":
        hidden = talker.transformer.hidden_size
        speaker_encoder = SpeakerEncoderConfig.parse(top.child("speaker_encoder_config"), hidden)
    return Qwen3TTSConfig(
        model_type=model_type,
        model_size=str(top.data.get("tts_model_size", "")),
        talker=talker,
        codec=codec,
        generation=generation,
        speaker_encoder=speaker_encoder,
        **tokens,
    )
