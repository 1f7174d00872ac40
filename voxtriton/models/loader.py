"""Load a Qwen3-TTS checkpoint directory in the official layout.

    config.json, generation_config.json, model.safetensors (or model.safetensors.index.json + shards),
    speech_tokenizer/config.json, speech_tokenizer/model.safetensors, tokenizer files (optional).

Our modules use the official parameter names except where projections are fused; the weight map
below says which official tensors fill which rows of a fused parameter. The same map tells
`make-checkpoint` which tensors an official checkpoint holds, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .codec import CodecModel
from .config import CheckpointError, Qwen3TTSConfig, load_config, parse_speech_encoder
from .layers import Attention, GatedMLP, Rotary
from .speaker_encoder import SpeakerEncoderRoot
from .speech_encoder import SpeechEncoder
from .talker import Qwen3TTSBackbone

log = logging.getLogger(__name__)

# fused parameter -> the official tensors stacked into its rows, in order
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Tensors the backbone and the codec decoder do not read: the tokenizer's audio encoder and the Base
# model's speaker encoder, loaded on their own (`load_speech_encoder`, `load_speaker_encoder`).
UNUSED_PREFIXES = ("encoder.", "speaker_encoder.")


@dataclass(frozen=True)
class TensorTarget:
    parameter: nn.Parameter
    rows: slice  # rows of `parameter` this checkpoint tensor fills

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows.stop - self.rows.start, *self.parameter.shape[1:])


def _fused_row_sizes(module: nn.Module, fused_name: str) -> tuple[int, ...]:
    if isinstance(module, Attention) and fused_name == "qkv_proj":
        return module.split
    if isinstance(module, GatedMLP) and fused_name == "gate_up_proj":
        half = module.gate_up_proj.weight.shape[0] // 2
        return (half, half)
    raise AssertionError(f"unknown fused projection {fused_name} in {type(module).__name__}")


def weight_map(root: nn.Module) -> dict[str, TensorTarget]:
    """Official tensor name -> where it goes in `root`."""
    targets: dict[str, TensorTarget] = {}
    for module_name, module in root.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            prefix = f"{module_name}." if module_name else ""
            owner, _, fused = module_name.rpartition(".")
            parts = FUSED_PROJECTIONS.get(fused)
            if parts is None:
                targets[prefix + param_name] = TensorTarget(param, slice(0, param.shape[0]))
                continue
            parent = root.get_submodule(owner)
            start = 0
            for part, size in zip(parts, _fused_row_sizes(parent, fused)):
                targets[f"{owner}.{part}.{param_name}"] = TensorTarget(param, slice(start, start + size))
                start += size
    return targets


class SafetensorsCheckpoint:
    """Name -> tensor access over one file or a sharded set described by an index."""

    def __init__(self, directory: Path, stem: str = "model"):
        single = directory / f"{stem}.safetensors"
        index = directory / f"{stem}.safetensors.index.json"
        if index.is_file():
            try:
                mapping = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(
                    f"{index}: not a safetensors index with a weight_map ({error})"
                ) from None
            self.files = {name: directory / shard for name, shard in mapping.items()}
            self.description = str(index)
        elif single.is_file():
            self.files = None
            self.single = single
            self.description = str(single)
        else:
            raise CheckpointError(f"{single}: file is missing (nor is there a {index.name})")
        self._handles: dict[Path, object] = {}
        self.names = set(self.files) if self.files is not None else set(self._open(single).keys())

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {self.description} is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot read safetensors file ({error})") from None
        return self._handles[path]

    def file_of(self, name: str) -> Path:
        return self.files[name] if self.files is not None else self.single

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.file_of(name)).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self._open(self.file_of(name)).get_tensor(name)

    def full_name(self, name: str) -> str:
        """The name as the file holds it (see `CheckpointView`)."""
        return name


def load_weights(root: nn.Module, checkpoint: SafetensorsCheckpoint, only: str | None = None) -> None:
    """Fill every parameter of `root` from the checkpoint; fail naming the first problem. only: the
    prefix of the tensors `root` reads, when the file holds other models' tensors too."""
    targets = weight_map(root)
    missing = sorted(set(targets) - checkpoint.names)
    if missing:
        shown = ", ".join(f"{n} {list(targets[n].shape)}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{checkpoint.description}: missing tensor(s) {shown}{more}")
    for name, target in targets.items():
        shape = checkpoint.shape(name)
        if shape != target.shape:
            raise CheckpointError(
                f"{checkpoint.file_of(name)}: tensor {checkpoint.full_name(name)} has shape {list(shape)}, "
                f"expected {list(target.shape)}"
            )
        with torch.no_grad():
            target.parameter[target.rows].copy_(checkpoint.tensor(name))
    unexpected = sorted(
        n
        for n in checkpoint.names - set(targets)
        if (n.startswith(only) if only else not n.startswith(UNUSED_PREFIXES))
    )
    if unexpected:
        log.warning(
            "%s: ignoring %d tensor(s) this model does not use, e.g. %s",
            checkpoint.description,
            len(unexpected),
            unexpected[:3],
        )


def _materialize(build, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build a module without initialising weights we are about to overwrite."""
    with torch.device("meta"):
        module = build()
    module = module.to(dtype=dtype).to_empty(device=device)
    for rotary in module.modules():
        if isinstance(rotary, Rotary):
            rotary.reset(device)
    return module.eval()


def load_backbone(
    checkpoint_dir: Path, config: Qwen3TTSConfig | None = None, device="cpu", dtype=torch.float32
) -> Qwen3TTSBackbone:
    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_config(checkpoint_dir)
    model = _materialize(lambda: Qwen3TTSBackbone(config), torch.device(device), dtype)
    load_weights(model, SafetensorsCheckpoint(checkpoint_dir))
    return model


def load_codec(
    checkpoint_dir: Path, config: Qwen3TTSConfig | None = None, device="cpu", dtype=torch.float32
) -> CodecModel:
    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_config(checkpoint_dir)
    model = _materialize(lambda: CodecModel(config.codec), torch.device(device), dtype)
    load_weights(model, SafetensorsCheckpoint(checkpoint_dir / "speech_tokenizer"))
    return model


def load_speaker_encoder(
    checkpoint_dir: Path, config: Qwen3TTSConfig | None = None, device="cpu", dtype=torch.float32
) -> SpeakerEncoderRoot:
    """The Base model's speaker encoder (`speaker_encoder.*` in model.safetensors)."""
    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_config(checkpoint_dir)
    if config.speaker_encoder is None:
        raise CheckpointError(
            f"{checkpoint_dir}: tts_model_type {config.model_type!r} has no speaker encoder"
        )
    model = _materialize(lambda: SpeakerEncoderRoot(config.speaker_encoder), torch.device(device), dtype)
    load_weights(model, SafetensorsCheckpoint(checkpoint_dir), only="speaker_encoder.")
    return model


def load_speech_encoder(
    checkpoint_dir: Path, config: Qwen3TTSConfig | None = None, device="cpu", dtype=torch.float32
) -> SpeechEncoder:
    """The speech tokenizer's audio encoder (`encoder.*` in speech_tokenizer/model.safetensors)."""
    checkpoint_dir = Path(checkpoint_dir)
    config = config or load_config(checkpoint_dir)
    path = checkpoint_dir / "speech_tokenizer" / "config.json"
    encoder = parse_speech_encoder(path)
    if encoder.num_codes != config.codec.num_quantizers:
        raise CheckpointError(
            f"{path}: encoder_valid_num_quantizers = {encoder.num_codes} does not match the decoder's "
            f"num_quantizers = {config.codec.num_quantizers}"
        )
    model = _materialize(lambda: SpeechEncoder(encoder), torch.device(device), dtype)
    load_weights(model, SafetensorsCheckpoint(checkpoint_dir / "speech_tokenizer"), only="encoder.")
    return model
