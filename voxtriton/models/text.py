"""Text side of Qwen3-TTS: tokenization and the talker prompt.

The checkpoint's own tokenizer (Qwen2 byte-level BPE from vocab.json + merges.txt) is built with
the `tokenizers` library the way transformers builds Qwen2TokenizerFast (same normalizer,
pre-tokenizer regex and BPE), so it gives transformers' ids (tests/test_text.py checks) without
importing transformers in the server. Special tokens are never parsed out of user text: their ids
come from config.json and are placed by the prompt builder, so "<|im_start|>" in a request is just
text. Without tokenizer files (random-weight checkpoints made with `--no-tokenizer`) a byte-level
fallback is used: each UTF-8 byte becomes the id of that byte's single-byte token in the Qwen2
vocabulary (GPT-2 byte order), so the real tokenizer would decode the ids back to the same text.

The prompt follows the official layouts. Both start with the role tokens and a codec prefix
(think / language / speaker / pad) under tts_pad text, then tts_bos. With the whole text known up
front (the official default for CustomVoice and VoiceDesign, `non_streaming_mode=True`), all text
tokens and tts_eos follow over codec_pad, then codec_bos; every generated frame is then fed with
tts_pad. In the interleaved layout (`non_streaming_mode=False`) only the first text token goes in
the prompt (over codec_bos) and the rest, then tts_eos, are fed one per generated frame.

A Base model's cloned voice (`Voice`) puts its x-vector where a preset speaker's codec token goes.
In-context, the codec prefix ends at codec_pad and what follows is the reference text, the text and
tts_eos beside codec_bos and the reference frames: with the whole text known, the text over
codec_pad and then the frames over tts_pad; interleaved, side by side, the longer side's tail (text)
fed one per frame. Vectors and frames are added to the positions' embeddings by the model runner.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import RequestError
from .config import Qwen3TTSConfig
from .voice import Voice

log = logging.getLogger(__name__)

NO_CODEC = -1  # prompt position without a codec token


def _gpt2_byte_order() -> list[int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    return printable + [b for b in range(256) if b not in printable]


BYTE_TOKEN_ID = {byte: index for index, byte in enumerate(_gpt2_byte_order())}


# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX)
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def qwen2_tokenizer(vocab_file: Path, merges_file: Path):
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in merges_file.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#version")
    ]
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class TextTokenizer:
    def __init__(self, checkpoint_dir: Path):
        checkpoint_dir = Path(checkpoint_dir)
        self.bpe = None
        vocab, merges = checkpoint_dir / "vocab.json", checkpoint_dir / "merges.txt"
        if vocab.is_file() and merges.is_file():
            self.bpe = qwen2_tokenizer(vocab, merges)
        else:
            log.warning("%s has no tokenizer files; using the byte-level fallback tokenizer", checkpoint_dir)

    @property
    def kind(self) -> str:
        return "checkpoint" if self.bpe is not None else "byte-fallback"

    def encode(self, text: str) -> list[int]:
        if self.bpe is not None:
            return self.bpe.encode(text, add_special_tokens=False).ids
        return [BYTE_TOKEN_ID[b] for b in text.encode("utf-8")]

    def settled_length(self, text: str) -> int:
        """How many leading characters of `text` tokenize the same whatever text follows: up to the
        start of its last pre-token (BPE merges stay within one), or all of it for the byte fallback."""
        if self.bpe is None:
            return len(text)
        words = self.bpe.pre_tokenizer.pre_tokenize_str(text)
        return words[-1][1][0] if words else 0

    def decode(self, ids: list[int]) -> str:
        if self.bpe is not None:
            return self.bpe.decode(ids)
        return bytes(_gpt2_byte_order()[i] for i in ids).decode("utf-8", errors="replace")


class TextStream:
    """Text that arrives in pieces, tokenized as the whole text would be: a piece's ids are given out
    once no later piece can change them (see `TextTokenizer.settled_length`), the rest at `finish`."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.pending = tokenizer, ""
        self.normalize = tokenizer.bpe is not None  # the checkpoint tokenizer's NFC, on the joined text

    def feed(self, piece: str) -> list[int]:
        self.pending += piece
        if self.normalize:
            self.pending = unicodedata.normalize("NFC", self.pending)
        cut = self.tokenizer.settled_length(self.pending)
        settled, self.pending = self.pending[:cut], self.pending[cut:]
        return self.tokenizer.encode(settled) if settled else []

    def finish(self) -> list[int]:
        rest, self.pending = self.pending, ""
        return self.tokenizer.encode(rest) if rest else []


@dataclass(frozen=True)
class Prompt:
    """Token-level talker prompt: per position a text id and a codec id (or NO_CODEC)."""

    text_ids: list[int]
    codec_ids: list[int]
    trailing_text_ids: list[int]  # fed one per frame after the prompt, then tts_pad forever
    speaker_embedding: np.ndarray | None = None  # a cloned voice's x-vector, added at speaker_position
    speaker_position: int = -1
    reference_codes: np.ndarray | None = None  # [T, codebooks] frames, from reference_position on
    reference_position: int = -1
    reference_key: str | None = None  # the voice's `Voice.key`: its primed codec state is kept


def languages_of(config: Qwen3TTSConfig) -> list[str]:
    """What a request's `language` may name: auto, or a language of the talker (dialects are picked
    by speaker)."""
    return ["auto"] + sorted(n for n in config.talker.languages if "dialect" not in n)


class PromptBuilder:
    def __init__(self, config: Qwen3TTSConfig, tokenizer: TextTokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.newline = tokenizer.encode("\n")
        self.user = tokenizer.encode("user")
        self.languages = languages_of(config)
        self.speakers = sorted(config.talker.speakers)

    def _role(self, role_ids: list[int]) -> list[int]:
        return [self.config.im_start_token_id, *role_ids, *self.newline]

    def build(
        self,
        text: str,
        speaker: str | None = None,
        language: str | None = None,
        instruct: str | None = None,
        interleaved: bool = False,
        voice: Voice | None = None,
    ) -> Prompt:
        text_ids = self.tokenizer.encode(text)
        if not text_ids:
            raise RequestError("text", "is empty")
        return self.head(speaker, language, instruct, voice).prompt(text_ids, interleaved)

    def head(
        self,
        speaker: str | None = None,
        language: str | None = None,
        instruct: str | None = None,
        voice: Voice | None = None,
    ) -> "PromptHead":
        """The prompt up to the text (role tokens and codec prefix), after checking the voice options."""
        cfg, talker = self.config, self.config.talker
        if cfg.clones_voices and voice is None:
            raise RequestError(
                "reference_audio", "is required by this Base model (or a registered voice in 'speaker')"
            )
        if voice is not None and not cfg.clones_voices:
            raise RequestError(
                "reference_audio", f"voice cloning needs a Base checkpoint; this one is {cfg.model_type}"
            )
        language = (language or "auto").lower()
        if language not in self.languages:
            raise RequestError(
                "language", f"unknown language {language!r}; supported: {', '.join(self.languages)}"
            )
        speaker = (speaker or "").lower() or None
        if cfg.model_type == "custom_voice":
            if speaker is None:
                raise RequestError(
                    "speaker", f"is required by this CustomVoice model; one of {', '.join(self.speakers)}"
                )
            if speaker not in talker.speakers:
                raise RequestError(
                    "speaker", f"unknown speaker {speaker!r}; supported: {', '.join(self.speakers)}"
                )
        elif speaker is not None:
            raise RequestError(
                "speaker",
                "this Base model has no preset speakers; give reference_audio or a registered voice"
                if cfg.clones_voices
                else "this VoiceDesign model has no preset speakers; describe the voice in 'instruct'",
            )
        if instruct and not cfg.supports_instruct:
            raise RequestError(
                "instruct",
                "not supported by Base checkpoints (the voice comes from the reference)"
                if cfg.clones_voices
                else f"not supported by this checkpoint (tts_model_size {cfg.model_size!r})",
            )

        language_id = None if language == "auto" else talker.languages[language]
        if speaker is not None and language in ("chinese", "auto") and talker.speaker_dialects[speaker]:
            language_id = talker.languages[talker.speaker_dialects[speaker]]
        if language_id is None:
            codec_prefix = [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id]
        else:
            codec_prefix = [
                talker.codec_think_id,
                talker.codec_think_bos_id,
                language_id,
                talker.codec_think_eos_id,
            ]
        if speaker is not None:
            codec_prefix.append(talker.speakers[speaker])
        if voice is not None:
            codec_prefix.append(NO_CODEC)  # the x-vector's position
        codec_prefix.append(talker.codec_pad_id)

        prefix_text: list[int] = []
        if instruct:
            prefix_text = (
                self._role(self.user) + self.tokenizer.encode(instruct) + [cfg.im_end_token_id, *self.newline]
            )
        prefix_text += self._role([cfg.assistant_token_id])
        text_side = prefix_text + [cfg.tts_pad_token_id] * (len(codec_prefix) - 1) + [cfg.tts_bos_token_id]
        codec_side = [NO_CODEC] * len(prefix_text) + codec_prefix
        reference_text = self.tokenizer.encode(voice.text) if voice is not None and voice.in_context else []
        return PromptHead(cfg, text_side, codec_side, voice, reference_text)


@dataclass(frozen=True)
class PromptHead:
    """A prompt's text and codec ids up to the text itself (and a cloned voice, with the ids of an
    in-context voice's transcript)."""

    config: Qwen3TTSConfig
    text_side: list[int]
    codec_side: list[int]
    voice: Voice | None = None
    reference_text_ids: list[int] = field(default_factory=list)

    def prompt(self, text_ids: list[int], interleaved: bool, text_ended: bool = True) -> Prompt:
        """The prompt for `text_ids`. In the interleaved layout they may be the text known so far (at
        least its first token; `text_ended` False): tts_eos follows the rest when the text ends."""
        cfg, talker = self.config, self.config.talker
        clone = {}
        if self.voice is not None:
            clone = dict(speaker_embedding=self.voice.embedding, speaker_position=len(self.codec_side) - 2)
            if self.voice.in_context:
                if not text_ended:
                    self.check_streamable()
                return self._in_context(text_ids, interleaved, clone)
        if interleaved:
            return Prompt(
                self.text_side + text_ids[:1],
                self.codec_side + [talker.codec_bos_id],
                text_ids[1:] + ([cfg.tts_eos_token_id] if text_ended else []),
                **clone,
            )
        text_side = self.text_side + text_ids + [cfg.tts_eos_token_id, cfg.tts_pad_token_id]
        codec_side = self.codec_side + [talker.codec_pad_id] * (len(text_ids) + 1) + [talker.codec_bos_id]
        return Prompt(text_side, codec_side, [], **clone)

    def check_streamable(self) -> None:
        """Refuse a voice whose prompt needs the whole text: an in-context one lays the text beside
        its reference frames."""
        if self.voice is not None and self.voice.in_context:
            raise RequestError(
                "speaker", "an in-context voice (one with a transcript) needs the whole text at once"
            )

    def _in_context(self, text_ids: list[int], interleaved: bool, clone: dict) -> Prompt:
        cfg, talker = self.config, self.config.talker
        texts = self.reference_text_ids + text_ids + [cfg.tts_eos_token_id]
        frames = len(self.voice.codes)
        codecs = [talker.codec_bos_id] + [NO_CODEC] * frames
        trailing: list[int] = []
        if not interleaved:
            texts, codecs = (
                texts + [cfg.tts_pad_token_id] * len(codecs),
                [talker.codec_pad_id] * len(texts) + codecs,
            )
        elif len(texts) > len(codecs):
            texts, trailing = texts[: len(codecs)], texts[len(codecs) :]
        else:
            texts = texts + [cfg.tts_pad_token_id] * (len(codecs) - len(texts))
        start = len(self.codec_side) + len(codecs) - frames
        return Prompt(
            self.text_side + texts,
            self.codec_side + codecs,
            trailing,
            reference_codes=self.voice.codes,
            reference_position=start,
            reference_key=self.voice.key,
            **clone,
        )
