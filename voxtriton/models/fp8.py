"""FP8 weights for the decoder layers' projections (the `fp8_weights` setting).

Each `nn.Linear` of a `DecoderLayer` (q/k/v, o, gate/up, down) of the talker, or of the talker and
the code predictor (`quantize_backbone`), is swapped at load for an `Fp8Linear`: its weight quantised
once to float8_e4m3fn with a scale per output channel, its input per token at every call, and the
product a row-wise scaled FP8 matrix product (`torch._scaled_mm`, bf16 out). That halves the bytes a
decode step reads for weights and runs the tensor cores at their FP8 rate. The heads, embeddings and
text projection stay in the model's dtype: logits round only once, in the head. Nothing syncs with
the host, so the frame step is captured in CUDA graphs as before.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp8 import FP8, quantize_rows, quantize_rows_reference
from .layers import DecoderLayer

# Row-wise scaled FP8 matrix products and Triton's FP8 loads need compute capability 8.9 (Ada) or newer.
FP8_CAPABILITY = (8, 9)


class Fp8Linear(nn.Module):
    """y = x @ W.T with W [out, in] in FP8 and a scale per output channel; x in bf16 (or fp32)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.reshape(1, -1))  # [1, out]: the layout _scaled_mm takes

    @staticmethod
    def from_linear(linear: nn.Linear) -> "Fp8Linear":
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes projections without a bias")
        weight, scale = quantize_rows_reference(linear.weight.detach())
        return Fp8Linear(weight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale = quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous())
        out = torch._scaled_mm(
            quantized, self.weight.t(), scale_a=scale, scale_b=self.scale, out_dtype=torch.bfloat16
        )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={FP8}"


def check_fp8_device(
    device: torch.device, setting: str = "fp8_weights", what: str = "FP8 matrix products"
) -> None:
    """Refuse a GPU without FP8 (`what` of the setting `setting`), naming the setting; the CPU runs the
    PyTorch formulas."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ValueError(
            f"{setting}: {what} need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )


def fp8_kv_runner_options(family, setting: str) -> dict:
    """The runner's keyword arguments for an `fp8_kv_cache` value of a `ModelFamily`: refused, naming the
    setting, for a family whose runner has no FP8 KV cache."""
    if setting == "off":
        return {}
    if not family.fp8_kv_cache:
        raise ValueError(f"fp8_kv_cache: an FP8 KV cache is for Qwen3-TTS checkpoints, not {family.name}")
    return {"fp8_kv_cache": setting}


@torch.no_grad()
def quantize_decoder_layers(root: nn.Module) -> int:
    """Swap every decoder layer's projections in `root` (in place) for `Fp8Linear`s; returns how many.
    Call after the weights are loaded and before CUDA graphs are captured."""
    check_fp8_device(next(root.parameters()).device)
    swapped = 0
    for layer in [module for module in root.modules() if isinstance(module, DecoderLayer)]:
        for owner in (layer.self_attn, layer.mlp):
            for name, child in list(owner.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(owner, name, Fp8Linear.from_linear(child))
                    swapped += 1
    return swapped


def quantize_backbone(backbone: nn.Module, scope: str) -> int:
    """`quantize_decoder_layers` over the parts of a `Qwen3TTSBackbone` that `scope` (an `fp8_weights`
    value) names: none, the talker (large weights, one step per frame), or the talker and the code
    predictor (small weights, 15 steps per frame, each paying for its inputs' quantisation). Returns
    how many projections were swapped."""
    talker = backbone.talker
    roots = {"off": [], "talker": [talker.model], "all": [talker.model, talker.code_predictor]}[scope]
    return sum(quantize_decoder_layers(root) for root in roots)
