"""CSM's prompt: the checkpoint's tokenizer, the turn to speak and a context turn before it.

The official prompt for text alone is the tokenizer's post-processed `[speaker]text`:
<|begin_of_text|>, the tokens of "[0]Hello.", <|end_of_text|>. The backbone then generates frames
from the last position. A context turn (a voice: words and the codes of their recording) comes
first, as CSM's chat template lays out a conversation: its `[speaker]text` turn, then one
<|AUDIO|> position per frame and one <|audio_eos|> position, whose embeddings are those of the
frames' codes and of an all-`codebook_eos_token_id` frame (`CsmPrompt.context_codes`). Special
tokens typed into the text stay text (`encode_special_tokens`). Without tokenizer files each UTF-8
byte becomes its single-byte token of the Llama 3 vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import RequestError
from ..text import BYTE_TOKEN_ID, Prompt
from ..voice import Voice
from .config import CsmConfig

log = logging.getLogger(__name__)

# CSM's text vocabulary is Llama 3's, where <|end_of_text|> follows <|begin_of_text|>.
END_OF_TEXT_OFFSET = 1


class CsmTokenizer:
    def __init__(self, checkpoint_dir: Path):
        path = Path(checkpoint_dir) / "tokenizer.json"
        self.tokenizer = None
        if path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))
            self.tokenizer.encode_special_tokens = True
        else:
            log.warning("%s has no tokenizer.json; using the byte-level fallback tokenizer", checkpoint_dir)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return [BYTE_TOKEN_ID[b] for b in text.encode("utf-8")]


def parse_speaker(value: object) -> int:
    """The speaker id of a request: a non-negative integer (or its decimal string); 0 by default."""
    if value is None or value == "":
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdecimal():
        return int(value)
    raise RequestError("speaker", f"{value!r} is not a speaker id (a non-negative integer such as 0 or 1)")


@dataclass(frozen=True)
class CsmPrompt(Prompt):
    """`text_ids` hold the audio positions' special tokens; `context_codes` [frames + 1, K] are the
    codes embedded there (the context frames, then the audio-EOS frame), from `context_position`."""

    context_codes: np.ndarray | None = None
    context_position: int = -1

    @property
    def text_tokens(self) -> int:
        """Positions that hold text (what the server's text limit counts)."""
        return len(self.text_ids) - (0 if self.context_codes is None else len(self.context_codes))


class CsmPromptBuilder:
    def __init__(self, config: CsmConfig, tokenizer: CsmTokenizer):
        self.config, self.tokenizer = config, tokenizer

    def build(self, text: str, speaker: object = None) -> list[int]:
        """One turn's ids: <|begin_of_text|>[speaker]text<|end_of_text|>."""
        if not text:
            raise RequestError("text", "is empty")
        bos = self.config.bos_token_id
        words = self.tokenizer.encode(f"[{parse_speaker(speaker)}]{text}")
        return [bos, *words, bos + END_OF_TEXT_OFFSET]

    def prompt(self, text: str, speaker: object = None, voice: Voice | None = None) -> CsmPrompt:
        """The prompt for `text` spoken by `speaker`; `voice`: a context turn by the same speaker (its
        transcript and the codes of its recording) that the new turn continues."""
        ids = self.build(text, speaker)
        if voice is None:
            return CsmPrompt(ids, [], [])
        if not voice.text:
            raise RequestError(
                "reference_text", "is required with reference_audio: CSM's context turn needs its words"
            )
        cfg = self.config
        context = self.build(voice.text, speaker)
        frames = len(voice.codes)
        eos_frame = np.full((1, cfg.num_codebooks), cfg.codebook_eos_token_id, dtype=np.int64)
        return CsmPrompt(
            context + [cfg.audio_token_id] * frames + [cfg.audio_eos_token_id] + ids,
            [],
            [],
            context_codes=np.concatenate((voice.codes.astype(np.int64), eos_frame)),
            context_position=len(context),
        )
