"""FP8 weights (`fp8_weights`): the row quantisation and its kernel, the FP8 projection, the swap at
load, the setting, and the error against the unswapped model. Runs on the CPU (PyTorch's FP8 matrix
product runs there too; the kernel in Triton's interpreter) and on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from voxtriton.bench import fidelity
from voxtriton.kernels.fp8 import FP8, FP8_MAX, quantize_rows_reference
from voxtriton.models.config import load_config
from voxtriton.models.fp8 import Fp8Linear, quantize_backbone
from voxtriton.models.layers import DecoderLayer
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.settings import FP8_SCOPES, TTSSettings

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[1]
SMALLEST_NORMAL = 2.0**-6  # of float8_e4m3fn; below it the grid is 2**-9 apart


def rows_with_range(generator, rows=4, width=96) -> torch.Tensor:
    """Rows of magnitudes across three decades and both signs, one row all zeros (a padding row)."""
    magnitude = torch.logspace(-1, 2, width)[torch.randperm(width, generator=generator)]
    signs = torch.randint(0, 2, (rows, width), generator=generator) * 2 - 1
    x = magnitude * signs * (torch.rand(rows, 1, generator=generator) + 0.5)
    x[1] = 0.0
    return x


def test_rows_round_trip_within_fp8_precision():
    x = rows_with_range(torch.Generator().manual_seed(0))
    quantized, scale = quantize_rows_reference(x)
    assert quantized.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (4, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    live = amax[:, 0] > 0
    # Each row's largest magnitude lands on the format's largest value, so its scale is amax / 448.
    assert torch.equal(quantized.float().abs().amax(dim=1)[live], torch.full((3,), FP8_MAX))
    torch.testing.assert_close(scale[live], amax[live] / FP8_MAX, rtol=1e-6, atol=0)
    # 3 mantissa bits: rounding moves a normal value by at most 2**-4 of it; a subnormal by half a step.
    restored = quantized.float() * scale
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((restored - x).abs() <= bound).all()
    # The zero row stays zero, with a finite scale.
    assert torch.equal(quantized[1].float(), torch.zeros(96)) and 0 < scale[1].item() < 1e-12


def test_the_kernel_gives_the_formulas_bits():
    """Same bits as `quantize_rows_reference`, bf16 and fp32 inputs. Triton's interpreter casts to FP8
    wrongly below the smallest normal value, so values that land there are tested on GPUs only."""
    pytest.importorskip("triton")
    from voxtriton.kernels.fp8 import quantize_rows_triton

    generator = torch.Generator().manual_seed(1)
    x = rows_with_range(generator, rows=5, width=6144)  # the widest projection input, the talker's FFN
    if DEVICE.type == "cuda":
        x[3, :100] *= 1e-4  # 2e-3 of the row's largest value and less: the grid's subnormal part
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        quantized, scale = quantize_rows_triton(rows.to(DEVICE))
        expected, expected_scale = quantize_rows_reference(rows)
        assert torch.equal(quantized.cpu().view(torch.uint8), expected.view(torch.uint8)), dtype
        assert torch.equal(scale.cpu(), expected_scale), dtype


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 64), (300, 64)])
def test_the_fp8_projection_is_the_product_of_its_dequantised_operands(shape):
    generator = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 96, bias=False).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=generator) * 0.05)
    x = torch.randn(*shape, generator=generator).to(DEVICE, torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    with torch.inference_mode():
        got, exact = fp8(x), linear(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.bfloat16
    quantized, scale = quantize_rows_reference(x.reshape(-1, 64))
    weight = fp8.weight.float() * fp8.scale.t()
    expected = ((quantized.float() * scale) @ weight.t()).view(got.shape)
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-3)  # bf16 rounding of the result
    # And FP8's own error against the bf16 product: a few percent of its magnitude.
    assert (got.float() - exact.float()).abs().mean() < 0.05 * exact.float().abs().mean()


@pytest.mark.parametrize("scope", ["off", "talker", "all"])
def test_only_the_decoder_layers_projections_of_the_scope_are_swapped(tiny_checkpoint, scope):
    config = load_config(tiny_checkpoint)
    plain = load_backbone(tiny_checkpoint, config, dtype=torch.bfloat16)
    swapped = load_backbone(tiny_checkpoint, config, dtype=torch.bfloat16)
    talker, predictor = config.talker.transformer.num_layers, config.talker.predictor.num_layers
    prefixes, layers = {
        "off": ((), 0),
        "talker": (("talker.model.",), talker),
        "all": (("talker.model.", "talker.code_predictor."), talker + predictor),
    }[scope]
    assert quantize_backbone(swapped, scope) == 4 * layers
    projections = [
        (name, child)
        for name, layer in swapped.named_modules()
        if isinstance(layer, DecoderLayer)
        for owner in (layer.self_attn, layer.mlp)
        for child in owner.children()
        if isinstance(child, (nn.Linear, Fp8Linear))
    ]
    assert len(projections) == 4 * (talker + predictor)
    for name, child in projections:
        assert isinstance(child, Fp8Linear if name.startswith(prefixes) else nn.Linear), name
    # Everything else (heads, embeddings, norms, projections outside the scope's layers) is untouched.
    kept = dict(swapped.named_parameters())
    for name, parameter in plain.named_parameters():
        projection = name.rsplit(".", 2)[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        if projection and name.startswith(prefixes):
            assert name not in kept
        else:
            assert torch.equal(kept.pop(name), parameter), name
    assert not kept


def test_the_setting_is_off_by_default_and_a_bad_value_names_it():
    def parse(value):
        return TTSSettings.from_model_config({"parameters": {"fp8_weights": {"string_value": value}}})[0]

    assert TTSSettings().fp8_weights == "off"
    assert [parse(scope).fp8_weights for scope in FP8_SCOPES] == ["off", "talker", "all"]
    with pytest.raises(ValueError, match="parameter 'fp8_weights' must be off, talker or all, got 'true'"):
        parse("true")


def test_fp8_logits_stay_within_fp8_precision_of_bf16(tiny_checkpoint):
    """Teacher-forced over 12 frames of 3 prompts: every codebook's mean logit error is a few percent
    of the logits' magnitude (FP8 keeps 3 mantissa bits); a misplaced scale would be off by ~100%."""
    config = load_config(tiny_checkpoint)
    prompts = PromptBuilder(config, TextTokenizer(tiny_checkpoint))
    reference = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=torch.bfloat16)
    candidate = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=torch.bfloat16)
    quantize_backbone(candidate, "all")
    requests = fidelity.greedy_requests(reference, prompts, 12, 3)
    positions = fidelity.positions_needed(requests, 12)
    report = fidelity.teacher_forced_logit_error(
        fidelity.new_runner(reference, 3, positions, graphs=False),
        fidelity.new_runner(candidate, 3, positions, graphs=False),
        requests,
        12,
    )
    assert [row["codebook"] for row in report] == list(range(16))
    for row in report:
        assert 0 < row["mean_abs_error_rel"] < 0.15, row
        assert row["max_abs_error_rel"] < 0.5, row


def test_fp8_check_runs_end_to_end(tmp_path, tiny_checkpoint):
    """benchmarks/fp8_check.py on the tiny checkpoint (on the CPU: eager steps), every variant (FP8
    weights, FP8 KV cache, both), so it cannot rot."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fp8_check.py"),
            "--checkpoint",
            str(tiny_checkpoint),
            "--device",
            str(DEVICE),
            "--frames",
            "6",
            "--prompts",
            "2",
            "--batch-sizes",
            "1,2",
            "--context",
            "64",
            "--repeat",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "fp8_check.json").read_text())
    variants = ["talker", "all", "kv-talker", "kv", "all+kv"]
    assert [row["batch"] for row in result["frame_step"]] == [1, 2]
    assert all(row[name] > 0 for row in result["frame_step"] for name in ["bf16", *variants])
    assert list(result["variants"]) == variants
    assert [found["projections"] for found in result["variants"].values()] == [8, 16, 0, 0, 16]
    kv = ["off", "off", "talker", "on", "on"]
    assert [found["fp8_kv_cache"] for found in result["variants"].values()] == kv
    for found in result["variants"].values():
        assert len(found["logit_error"]) == 16 and len(found["code_agreement"]["per_codebook"]) == 16
    # Decode attention alone, bf16 (fp32 here) against FP8 keys and values (in Triton's interpreter here).
    assert [row["batch"] for row in result["decode_attention"]] == [1, 2]
    assert all(row["bf16_us"] > 0 and row["fp8_us"] > 0 for row in result["decode_attention"])
    assert result["meta"]["frames"] == 6
    report = (tmp_path / "fp8_check.md").read_text()
    assert "RANDOM weights" in report and "fp8_kv_cache on" in report and "Decode attention" in report


def assert_the_server_streams_the_in_process_codes(
    checkpoint, backbone, prompts, parameters: dict, fp8_kv_cache: str = "off", frames: int = 20
) -> str:
    """A greedy request through a real tritonserver started with these `tts` parameters streams the codes
    `backbone` decodes in process (with that `fp8_kv_cache`); returns the server's log."""
    from server_helpers import start_server
    from voxtriton_client import TTSClient

    requests = fidelity.greedy_requests(backbone, prompts, frames, 1)
    positions = fidelity.positions_needed(requests, frames)
    runner = fidelity.new_runner(backbone, 1, positions, graphs=False, fp8_kv_cache=fp8_kv_cache)
    expected = fidelity.decode_frames(runner, requests, frames)[0]
    with start_server(checkpoint, parameters={"tts": parameters}) as server:
        synthesis = TTSClient(server.grpc_url).synthesize(
            fidelity.TEXTS[0],
            speaker=prompts.speakers[0],
            temperature=0.0,
            seed=0,
            max_frames=frames,
            ignore_eos=True,
            codes=True,
        )
        log = server.log_file.read_text(errors="replace")
    np.testing.assert_array_equal(synthesis.raise_for_error().codes, expected)
    return log


@pytest.mark.server
def test_a_server_with_fp8_weights_streams_the_fp8_models_codes(tiny_checkpoint):
    """`tts:fp8_weights=all` through a real tritonserver: the tts model swaps its projections, and a
    greedy request's codes are those the FP8 model decodes in process."""
    config = load_config(tiny_checkpoint)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the server's (dtype auto)
    backbone = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=dtype)
    projections = quantize_backbone(backbone, "all")
    prompts = PromptBuilder(config, TextTokenizer(tiny_checkpoint))
    log = assert_the_server_streams_the_in_process_codes(
        tiny_checkpoint, backbone, prompts, {"fp8_weights": "all"}
    )
    assert f"FP8 weights for {projections} projections" in log
