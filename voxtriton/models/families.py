"""The model families voxtriton serves, keyed by the `model_type` of a checkpoint's config.json.

A new family is one entry here and its description (`models.family.ModelFamily`); the engine, the
codec lanes, the scheduler and the Triton models take everything else from that description.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .config import _Fields, read_json
from .csm.family import csm_family
from .family import ModelFamily
from .qwen3_tts_family import qwen3_tts_family

FAMILIES: dict[str, Callable[[Path], ModelFamily]] = {
    "qwen3_tts": qwen3_tts_family,
    "csm": csm_family,
}
# Each family's files in the official layout, each with its alternatives (a sharded checkpoint has an
# index).
CHECKPOINT_FILES: dict[str, tuple[tuple[str, ...], ...]] = {
    "qwen3_tts": (
        ("config.json",),
        ("model.safetensors", "model.safetensors.index.json"),
        ("speech_tokenizer/config.json",),
        ("speech_tokenizer/model.safetensors", "speech_tokenizer/model.safetensors.index.json"),
    ),
    "csm": (("config.json",), ("model.safetensors", "model.safetensors.index.json")),
}


def model_type(checkpoint_dir: Path) -> str:
    """The checkpoint's config.json `model_type`, checked against the families served."""
    path = Path(checkpoint_dir) / "config.json"
    return _Fields(path, read_json(path)).equals("model_type", *FAMILIES)


def load_family(checkpoint_dir: Path) -> ModelFamily:
    """The family of the checkpoint in `checkpoint_dir`, described from its files."""
    return FAMILIES[model_type(checkpoint_dir)](Path(checkpoint_dir))
