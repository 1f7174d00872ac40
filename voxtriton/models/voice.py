"""A cloned voice: what the Base model's prompt needs from a reference recording, computed once.

`embedding` is the speaker encoder's x-vector; `codes` the speech tokenizer's codes of the
recording; `text` its transcript. With a transcript the prompt is in-context (the reference text
and codes lead the prompt, and the codec decodes the generated frames after the reference codes);
without one it is x-vector only, and `codes` are not used. A registered voice, and an inline one the
server keeps (`reference_cache`), has a `key`, a digest of its codes, under which the server keeps
the codec state primed with them for the voice's next streams.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Voice:
    embedding: np.ndarray  # [enc_dim] float32
    codes: np.ndarray  # [frames, codebooks] int64
    text: str | None = None
    key: str | None = None  # registered voices and kept inline ones: `codes_key(codes)`

    @property
    def in_context(self) -> bool:
        return bool(self.text)

    @property
    def prime_codes(self) -> np.ndarray | None:
        """Codes the codec decodes, silently, before the generated frames (in-context prompts only)."""
        return self.codes if self.in_context else None


def codes_key(codes: np.ndarray) -> str:
    """Reference codes' identity: equal codes prime the codec to equal states."""
    codes = np.ascontiguousarray(codes, dtype=np.int64)
    return f"{codes.shape[0]}x{codes.shape[1]}:" + hashlib.sha256(codes.tobytes()).hexdigest()[:32]
