"""A cloned voice: what the Base model's prompt needs from a reference recording, computed once.

`embedding` is the speaker encoder's x-vector; `codes` the speech tokenizer's codes of the
recording; `text` its transcript. With a transcript the prompt is in-context (the reference text
and codes lead the prompt, and the codec decodes the generated frames after the reference codes);
without one it is x-vector only, and `codes` are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Voice:
    embedding: np.ndarray  # [enc_dim] float32
    codes: np.ndarray  # [frames, codebooks] int64
    text: str | None = None

    @property
    def in_context(self) -> bool:
        return bool(self.text)

    @property
    def prime_codes(self) -> np.ndarray | None:
        """Codes the codec decodes, silently, before the generated frames (in-context prompts only)."""
        return self.codes if self.in_context else None
