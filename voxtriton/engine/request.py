"""Per-request state of the generation engine (no tensors: those live in the model runner's rows)."""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field

from ..errors import RequestError
from ..models.family import SamplingDefaults
from ..models.qwen3_tts_family import qwen3_tts_sampling
from ..models.text import Prompt


@dataclass(frozen=True)
class GenerationParams:
    """Sampling for codebook 0 (backbone) and the later codebooks (depth predictor), plus length
    control.

    Defaults come from the model family (the checkpoint's generation_config.json); a request's
    temperature / top_k / top_p override both the backbone's and the predictor's values.
    """

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    sub_temperature: float
    sub_top_k: int
    sub_top_p: float
    seed: int
    max_frames: int
    ignore_eos: bool = False

    @staticmethod
    def create(
        defaults: SamplingDefaults | dict,
        max_frames_limit: int,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        max_frames: int | None = None,
        ignore_eos: bool = False,
    ) -> "GenerationParams":
        """defaults: the model family's sampling defaults, or a Qwen3-TTS generation_config.json."""
        d = defaults if isinstance(defaults, SamplingDefaults) else qwen3_tts_sampling(defaults)

        def pick(value, default):
            return value if value is not None else default

        default_frames = max_frames_limit if d.max_frames is None else min(d.max_frames, max_frames_limit)
        params = GenerationParams(
            temperature=float(pick(temperature, d.temperature)),
            top_k=int(pick(top_k, d.top_k)),
            top_p=float(pick(top_p, d.top_p)),
            repetition_penalty=float(pick(repetition_penalty, d.repetition_penalty)),
            sub_temperature=float(pick(temperature, d.depth_temperature)),
            sub_top_k=int(pick(top_k, d.depth_top_k)),
            sub_top_p=float(pick(top_p, d.depth_top_p)),
            seed=int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed),
            max_frames=int(pick(max_frames, default_frames)),
            ignore_eos=bool(ignore_eos),
        )
        params.validate(max_frames_limit)
        return params

    def validate(self, max_frames_limit: int) -> None:
        for name, value in (("temperature", self.temperature), ("temperature", self.sub_temperature)):
            if not math.isfinite(value) or value < 0:
                raise RequestError(name, f"must be a finite number >= 0 (0 = greedy), got {value}")
        for name, value in (("top_p", self.top_p), ("top_p", self.sub_top_p)):
            if not (math.isfinite(value) and 0 < value <= 1):
                raise RequestError(name, f"must be in (0, 1], got {value}")
        for name, value in (("top_k", self.top_k), ("top_k", self.sub_top_k)):
            if value < 0:
                raise RequestError(name, f"must be >= 0 (0 = no limit), got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        if not 1 <= self.max_frames <= max_frames_limit:
            raise RequestError(
                "max_frames", f"must be between 1 and {max_frames_limit}, got {self.max_frames}"
            )
        if not -(2**63) <= self.seed < 2**64:
            raise RequestError("seed", "must fit in 64 bits")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: Prompt
    params: GenerationParams
    status: Status = Status.WAITING
    row: int | None = None  # row in the runner's batch while running
    frames: int = 0  # frames launched: generated, or in a frame step on its way
    emitted: int = 0  # frames returned by the engine
    finish_reason: str | None = None  # eos | max_frames | cancelled
    cancelled: bool = field(default=False, repr=False)
    # Input streaming: more text may come (`Engine.add_text`); until it ends, frames wait for it.
    text_open: bool = False
    # Input streaming: its first chunk's frames at least while its text arrives (None: the server's
    # `scheduler_text_start_frames`); the scheduler's, carried here from the first piece.
    start_frames: int | None = None
    text: list[int] = field(init=False, repr=False)  # text ids fed one per frame: those known so far
    text_written: int = 0  # of them, those in the request's row
    paused: bool = False  # waits for text (its row kept, no frame generated)

    def __post_init__(self):
        self.text = list(self.prompt.trailing_text_ids)

    @property
    def position(self) -> int:
        """Next KV-cache position: prompt tokens plus one per frame fed back."""
        return len(self.prompt.text_ids) + self.frames
