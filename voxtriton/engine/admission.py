"""An admission's inputs as one flat int64 array: packed on the host, uploaded in one copy, read on the
device through views.

The engine thread admits requests between frame steps, and every PyTorch call it makes there gives
the GIL away to the tts process's other threads, which can keep it for up to the switch interval
(`benchmarks/admission_cost.py`). So an admission packs everything its rows need into one array with
numpy: the first row; per request its row scalars (float64 bits: every value is exact in a double)
and trailing text ids; per prompt its last index, text ids and codec ids. Views of one static buffer
at fixed offsets are what the prefill and row-writing CUDA graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .request import Request
from .sampling import fold_seed

# The request values an admission writes into each of its rows, in the order of their columns: the
# sampling parameters, then the folded seed and the prompt length (the row's first KV position).
ROW_SCALARS = (
    "repetition_penalty",
    "ignore_eos",
    "temperature",
    "top_k",
    "top_p",
    "sub_temperature",
    "sub_top_k",
    "sub_top_p",
    "seed",
    "position",
)


@dataclass
class AdmissionInputs:
    """Device views of one admission's inputs; `count` requests, prompts padded to [batch, length]."""

    first_row: torch.Tensor  # [1] int64
    scalars: torch.Tensor  # [count, len(ROW_SCALARS)] float64
    trailing: torch.Tensor  # [count, trailing width] int64
    last_index: torch.Tensor  # [batch] int64
    text: torch.Tensor  # [batch, length] int64
    codec: torch.Tensor  # [batch, length] int64


@dataclass(frozen=True)
class AdmissionLayout:
    """Offsets in the flat array for up to `capacity` requests with trailing text of `trailing_width`
    columns. The per-request parts sit at offsets fixed by the capacity; the prompts come last, packed
    at the shape of the admission's prefill, [batch, length]."""

    capacity: int
    trailing_width: int

    @property
    def _scalars(self) -> int:
        return 1

    @property
    def _trailing(self) -> int:
        return self._scalars + self.capacity * len(ROW_SCALARS)

    @property
    def _last_index(self) -> int:
        return self._trailing + self.capacity * self.trailing_width

    @property
    def _text(self) -> int:
        return self._last_index + self.capacity

    def size(self, batch: int, length: int) -> int:
        """Values an admission of prompts padded to [batch, length] uses (a prefix of the array)."""
        return self._text + 2 * batch * length

    def pack(
        self,
        requests: list[Request],
        first_row: int,
        batch: int,
        length: int,
        pad_text_id: int,
        no_codec: int,
    ) -> np.ndarray:
        """The inputs of admitting `requests` into rows first_row.., prompts padded to [batch, length]
        (text with 0, codec with `no_codec`), trailing text with `pad_text_id`."""
        count = len(requests)
        if not count <= batch <= self.capacity:
            raise ValueError(
                f"an admission of {count} requests padded to {batch} does not fit {self.capacity}"
            )
        flat = np.zeros(self.size(batch, length), dtype=np.int64)
        flat[0] = first_row
        scalars = np.array(
            [
                [float(getattr(r.params, name)) for name in ROW_SCALARS[:-2]]
                + [float(fold_seed(r.params.seed)), float(len(r.prompt.text_ids))]
                for r in requests
            ]
        )
        flat[self._scalars : self._scalars + scalars.size] = scalars.reshape(-1).view(np.int64)
        trailing = flat[self._trailing : self._last_index].reshape(self.capacity, self.trailing_width)
        trailing[:count] = pad_text_id
        text = flat[self._text : self._text + batch * length].reshape(batch, length)
        codec = flat[self._text + batch * length :].reshape(batch, length)
        codec[:] = no_codec
        for i, request in enumerate(requests):
            prompt = request.prompt
            trailing[i, : len(request.text)] = request.text
            text[i, : len(prompt.text_ids)] = prompt.text_ids
            codec[i, : len(prompt.codec_ids)] = prompt.codec_ids
            flat[self._last_index + i] = len(prompt.text_ids) - 1
        return flat

    def views(self, flat: torch.Tensor, count: int, batch: int, length: int) -> AdmissionInputs:
        """`flat` (at least `size(batch, length)` values) seen as the inputs `pack` wrote."""
        scalars = (
            flat[self._scalars : self._trailing].view(torch.float64).view(self.capacity, len(ROW_SCALARS))
        )
        trailing = flat[self._trailing : self._last_index].view(self.capacity, self.trailing_width)
        return AdmissionInputs(
            first_row=flat[:1],
            scalars=scalars[:count],
            trailing=trailing[:count],
            last_index=flat[self._last_index : self._last_index + batch],
            text=flat[self._text : self._text + batch * length].view(batch, length),
            codec=flat[self._text + batch * length : self._text + 2 * batch * length].view(batch, length),
        )
