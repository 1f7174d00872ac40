"""Load a CSM checkpoint directory in the official layout (`sesame/csm-1b`).

    config.json, model.safetensors (or model.safetensors.index.json + shards) holding the backbone,
    the depth decoder and the codec (`codec_model.*`: its decoder, and its encoder for context
    audio), tokenizer files (optional).

One file holds both models; each loads from its view of it, so errors name the file and the
checkpoint's own tensor name.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..loader import SafetensorsCheckpoint, _materialize, load_weights
from ..speech_encoder import MimiEncoder
from .config import CsmConfig, load_csm_config
from .mimi import MimiCodec
from .model import CsmModel

CODEC_PREFIX = "codec_model."
# The codec's encoder side (context audio -> codes) and its decoder side, loaded on their own.
CODEC_ENCODER_PREFIXES = ("encoder.", "encoder_transformer.", "downsample.")
CODEC_ENCODER_SUFFIXES = (".input_proj.weight",)
CODEC_DECODER_PREFIXES = ("decoder.", "decoder_transformer.", "upsample.")


class CheckpointView:
    """The tensors of a checkpoint under `prefix` (named without it), leaving out `exclude`d names:
    what `load_weights` needs, with error messages that name the file and the full tensor name."""

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        prefix: str = "",
        exclude: tuple[str, ...] = (),
        exclude_suffixes: tuple[str, ...] = (),
    ):
        self.checkpoint, self.prefix = checkpoint, prefix
        self.description = checkpoint.description + (f" (tensors under {prefix!r})" if prefix else "")
        self.names = {
            name[len(prefix) :]
            for name in checkpoint.names
            if name.startswith(prefix)
            and not name[len(prefix) :].startswith(exclude)
            and not name.endswith(exclude_suffixes)
        }

    def file_of(self, name: str) -> Path:
        return self.checkpoint.file_of(self.prefix + name)

    def full_name(self, name: str) -> str:
        return self.prefix + name

    def shape(self, name: str) -> tuple[int, ...]:
        return self.checkpoint.shape(self.prefix + name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.checkpoint.tensor(self.prefix + name)


def _load(checkpoint_dir: Path, build, view: dict, device, dtype):
    model = _materialize(build, torch.device(device), dtype)
    load_weights(model, CheckpointView(SafetensorsCheckpoint(Path(checkpoint_dir)), **view))
    return model


def load_csm(
    checkpoint_dir: Path, config: CsmConfig | None = None, device="cpu", dtype=torch.float32
) -> CsmModel:
    config = config or load_csm_config(Path(checkpoint_dir))
    return _load(checkpoint_dir, lambda: CsmModel(config), dict(exclude=(CODEC_PREFIX,)), device, dtype)


def load_mimi(
    checkpoint_dir: Path, config: CsmConfig | None = None, device="cpu", dtype=torch.float32
) -> MimiCodec:
    config = config or load_csm_config(Path(checkpoint_dir))
    view = dict(prefix=CODEC_PREFIX, exclude=CODEC_ENCODER_PREFIXES, exclude_suffixes=CODEC_ENCODER_SUFFIXES)
    return _load(checkpoint_dir, lambda: MimiCodec(config.codec), view, device, dtype)


def load_mimi_encoder(
    checkpoint_dir: Path, config: CsmConfig | None = None, device="cpu", dtype=torch.float32
) -> MimiEncoder:
    """The codec's encoder side: 24 kHz audio -> codes [B, frames, num_codebooks]."""
    config = config or load_csm_config(Path(checkpoint_dir))
    view = dict(prefix=CODEC_PREFIX, exclude=CODEC_DECODER_PREFIXES)
    return _load(checkpoint_dir, lambda: MimiEncoder(config.codec_encoder), view, device, dtype)
