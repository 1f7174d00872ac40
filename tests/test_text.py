"""Tokenizer (checkpoint files or byte fallback), prompt layout and request validation."""

from __future__ import annotations

import pytest

from voxtriton.errors import RequestError
from voxtriton.models.config import load_config
from voxtriton.models.text import NO_CODEC, PromptBuilder, TextTokenizer


@pytest.fixture(scope="module")
def builder(tiny_checkpoint):
    return PromptBuilder(load_config(tiny_checkpoint), TextTokenizer(tiny_checkpoint))


def test_byte_fallback_ids_decode_back_with_the_real_vocabulary(
    tiny_checkpoint, tiny_checkpoint_no_tokenizer
):
    real = TextTokenizer(tiny_checkpoint)
    fallback = TextTokenizer(tiny_checkpoint_no_tokenizer)
    assert (real.kind, fallback.kind) == ("checkpoint", "byte-fallback")
    for text in ("Hello, world!", "naïve café — 你好", "line\nbreak\ttab"):
        ids = fallback.encode(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert real.decode(ids) == text


def test_checkpoint_tokenizer_matches_transformers(tiny_checkpoint):
    """Ours is built with `tokenizers` directly; transformers' Qwen2 tokenizer is the reference."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    ours = TextTokenizer(tiny_checkpoint)
    samples = [
        "Hello, world!",
        "  leading spaces and trailing  ",
        "It's 3:45pm -- isn't it?",
        "naïve café",
        "你好，世界。今天天气很好！",
        "こんにちは、元気ですか",
        "Line one\nLine two\r\n\n\tTabbed",
        "Numbers 1234567890 and 3.14159",
        "Émojis 🎉🔊 and symbols ©®™",
        "MixedCASE words, ALLCAPS.",
        "don't you'll we've I'm they'd she's",
        "a" * 300,
        "Ünïcödé ñ ß ø Å",
    ]
    for text in samples:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text


def test_special_tokens_in_user_text_stay_text(builder):
    ids = builder.tokenizer.encode("<|im_start|>assistant")
    assert builder.config.im_start_token_id not in ids


def test_full_text_prompt_layout(builder):
    cfg = builder.config
    prompt = builder.build("Hi there", speaker="Ryan", language="English")
    text_ids = builder.tokenizer.encode("Hi there")
    talker = cfg.talker
    assert prompt.text_ids[:3] == [cfg.im_start_token_id, cfg.assistant_token_id, 198]
    assert prompt.codec_ids[:3] == [NO_CODEC] * 3
    codec_prefix = [
        talker.codec_think_id,
        talker.codec_think_bos_id,
        talker.languages["english"],
        talker.codec_think_eos_id,
        talker.speakers["ryan"],
        talker.codec_pad_id,
    ]
    assert prompt.codec_ids[3:9] == codec_prefix
    assert prompt.text_ids[3:9] == [cfg.tts_pad_token_id] * 5 + [cfg.tts_bos_token_id]
    assert prompt.text_ids[9:] == text_ids + [cfg.tts_eos_token_id, cfg.tts_pad_token_id]
    assert prompt.codec_ids[9:] == [talker.codec_pad_id] * (len(text_ids) + 1) + [talker.codec_bos_id]
    assert prompt.trailing_text_ids == []


def test_interleaved_prompt_feeds_text_per_frame(builder):
    prompt = builder.build("Hi there", speaker="ryan", interleaved=True)
    ids = builder.tokenizer.encode("Hi there")
    assert prompt.text_ids[-1] == ids[0] and prompt.codec_ids[-1] == builder.config.talker.codec_bos_id
    assert prompt.trailing_text_ids == ids[1:] + [builder.config.tts_eos_token_id]
    # language auto: no language id, "nothink" prefix
    assert prompt.codec_ids[3] == builder.config.talker.codec_nothink_id


def test_dialect_speaker_uses_dialect_language(builder):
    talker = builder.config.talker
    prompt = builder.build("你好", speaker="eric", language="chinese")
    assert talker.languages["sichuan_dialect"] in prompt.codec_ids


def test_instruct_is_prepended_as_a_user_turn(builder):
    plain = builder.build("Hi", speaker="ryan")
    styled = builder.build("Hi", speaker="ryan", instruct="whisper")
    extra = len(styled.text_ids) - len(plain.text_ids)
    assert styled.text_ids[extra:] == plain.text_ids
    assert styled.text_ids[0] == builder.config.im_start_token_id
    assert styled.codec_ids[:extra] == [NO_CODEC] * extra


@pytest.mark.parametrize(
    "kwargs,field,message",
    [
        (dict(text="", speaker="ryan"), "text", "is empty"),
        (dict(text="hi", speaker="nobody"), "speaker", "unknown speaker 'nobody'"),
        (dict(text="hi"), "speaker", "is required"),
        (dict(text="hi", speaker="ryan", language="klingon"), "language", "unknown language 'klingon'"),
    ],
)
def test_bad_requests_name_the_field(builder, kwargs, field, message):
    with pytest.raises(RequestError, match=message) as info:
        builder.build(**kwargs)
    assert info.value.field == field


def test_instruct_refused_where_the_model_lacks_it(tmp_path):
    import json
    import shutil

    from voxtriton.models.random_checkpoint import PRESET_DIR, preset_configs

    config, speech = preset_configs("0.6b")
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "speech_tokenizer" / "config.json").write_text(json.dumps(speech))
    shutil.copyfile(PRESET_DIR / "common" / "generation_config.json", tmp_path / "generation_config.json")
    builder = PromptBuilder(load_config(tmp_path), TextTokenizer(tmp_path))
    with pytest.raises(RequestError, match="instruct: not supported by this checkpoint"):
        builder.build("hi", speaker="ryan", instruct="angry")
