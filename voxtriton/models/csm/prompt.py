"""CSM's text side: the checkpoint's tokenizer and the prompt for one utterance.

The official prompt for text alone is the tokenizer's post-processed `[speaker]text`:
<|begin_of_text|>, the tokens of "[0]Hello.", <|end_of_text|>. The backbone then generates frames
from the last position. Special tokens typed into the text stay text (`encode_special_tokens`).
Without tokenizer files each UTF-8 byte becomes its single-byte token of the Llama 3 vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ...errors import RequestError
from ..text import BYTE_TOKEN_ID
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


class CsmPromptBuilder:
    def __init__(self, config: CsmConfig, tokenizer: CsmTokenizer):
        self.config, self.tokenizer = config, tokenizer

    def build(self, text: str, speaker: object = None) -> list[int]:
        if not text:
            raise RequestError("text", "is empty")
        bos = self.config.bos_token_id
        words = self.tokenizer.encode(f"[{parse_speaker(speaker)}]{text}")
        return [bos, *words, bos + END_OF_TEXT_OFFSET]
