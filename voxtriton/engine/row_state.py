"""Every running request's row state: what a frame step reads and writes, one row per request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from .admission import ROW_SCALARS, AdmissionInputs
from .sampling import RowParams


@dataclass(frozen=True, eq=False)
class Rows:
    """Per-row tensors [max_rows, ...] of a family's runner; running requests occupy rows 0..B-1. CUDA
    graphs capture these tensors' addresses, so they are allocated once and only written in place
    (frozen: never rebound). These fields are every family's; a family's rows add their own."""

    frame_index: torch.Tensor  # int64
    position: torch.Tensor  # int64: the next KV position
    seen: torch.Tensor  # [R, vocab] bool: codebook-0 tokens drawn so far (the repetition penalty's)
    penalty: torch.Tensor  # float32: repetition penalty
    ignore_eos: torch.Tensor  # bool
    main: RowParams  # codebook 0's sampling
    sub: RowParams  # the depth predictor's; its seeds are main's

    @classmethod
    def allocate_with(cls, rows: int, vocab: int, device: torch.device, **family_fields):
        """Idle rows: the shared fields zeroed (penalty 1), with the family's own `family_fields`."""

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, device=device, dtype=dtype)

        def params(seeds: torch.Tensor) -> RowParams:
            return RowParams(
                zeros(rows, dtype=torch.float32), zeros(rows), zeros(rows, dtype=torch.float32), seeds
            )

        main = params(zeros(rows))
        return cls(
            frame_index=zeros(rows),
            position=zeros(rows),
            seen=zeros(rows, vocab, dtype=torch.bool),
            penalty=torch.ones(rows, device=device, dtype=torch.float32),
            ignore_eos=zeros(rows, dtype=torch.bool),
            main=main,
            sub=params(main.seeds),
            **family_fields,
        )

    @cached_property
    def scalar_columns(self) -> list[torch.Tensor]:
        """Where an admission writes each of its ROW_SCALARS, in their order."""
        by_name = {
            "repetition_penalty": self.penalty,
            "ignore_eos": self.ignore_eos,
            "temperature": self.main.temperature,
            "top_k": self.main.top_k,
            "top_p": self.main.top_p,
            "sub_temperature": self.sub.temperature,
            "sub_top_k": self.sub.top_k,
            "sub_top_p": self.sub.top_p,
            "seed": self.main.seeds,
            "position": self.position,
        }
        return [by_name[name] for name in ROW_SCALARS]

    @cached_property
    def tensors(self) -> list[torch.Tensor]:
        """Every row tensor once, in field order (what moving or restoring a row covers)."""
        found: list[torch.Tensor] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values = (
                [getattr(value, f.name) for f in dataclasses.fields(value)]
                if isinstance(value, RowParams)
                else [value]
            )
            found.extend(t for t in values if not any(t is known for known in found))
        return found

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy row `source` onto row `target` ([1] index tensors)."""
        for tensor in self.tensors:
            tensor.index_copy_(0, target, tensor.index_select(0, source))

    def reset(self, rows: slice) -> None:
        """Put rows that no request uses back in a harmless state (positions inside the cache)."""
        self.position[rows] = 0
        self.frame_index[rows] = 0

    def admit(self, rows: torch.Tensor, inputs: AdmissionInputs) -> None:
        """Start `rows` (indices) for admitted requests: their scalars, nothing seen, frame 0."""
        for index, column in enumerate(self.scalar_columns):
            column.index_copy_(0, rows, inputs.scalars[:, index].to(column.dtype))
        self.seen.index_fill_(0, rows, False)
        self.frame_index.index_fill_(0, rows, 0)


@dataclass(frozen=True, eq=False)
class RowState(Rows):
    """Qwen3-TTS's rows (the `Rows` fields first)."""

    last_code: torch.Tensor  # int64: codebook-0 token of the frame to complete next
    past_hidden: torch.Tensor  # [R, hidden]: the talker output that produced it
    trailing: torch.Tensor  # [R, text + 1] int64: row r feeds trailing[r, min(frame, last column)]
    hold: torch.Tensor  # bool: the row waits for text; a frame step leaves its state as it was

    @classmethod
    def allocate(
        cls,
        rows: int,
        hidden_size: int,
        vocab: int,
        trailing_width: int,
        pad_text_id: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> RowState:
        """Idle rows; trailing text is padded with `pad_text_id`."""
        return cls.allocate_with(
            rows,
            vocab,
            device,
            last_code=torch.zeros(rows, device=device, dtype=torch.long),
            past_hidden=torch.zeros(rows, hidden_size, device=device, dtype=dtype),
            trailing=torch.full((rows, trailing_width), pad_text_id, device=device, dtype=torch.long),
            hold=torch.zeros(rows, device=device, dtype=torch.bool),
        )

    def admit(self, rows: torch.Tensor, inputs: AdmissionInputs) -> None:
        """`Rows.admit`, with their trailing text and no hold."""
        super().admit(rows, inputs)
        self.trailing.index_copy_(0, rows, inputs.trailing)
        self.hold.index_fill_(0, rows, False)
