"""The Triton kernels against their reference formulas: on the GPU where there is one, otherwise in
Triton's interpreter (conftest.py), so CI checks the same kernel code the GPU runs."""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from voxtriton.kernels import attention
from voxtriton.kernels import codec as kernels

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random(*shape, scale=1.0, dtype=torch.float32, generator):
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("history_length, tail", [(0, 0), (1, 0), (18, 0), (18, 8), (0, 2)])
def test_snake_matches_the_reference(dtype, with_bias, history_length, tail):
    generator = torch.Generator().manual_seed(history_length * 2 + with_bias)
    batch, channels, length = 2, 5, 1500  # two column blocks, the second partly masked
    # x as a strided view (every other channel of a wider tensor), as a trimmed convolution output is.
    x = random(batch, 2 * channels, length, scale=3, dtype=dtype, generator=generator)[:, ::2]
    log_alpha, log_beta = (
        random(channels, scale=0.5, generator=generator),
        random(channels, scale=0.5, generator=generator),
    )
    bias = random(channels, dtype=dtype, generator=generator) if with_bias else None
    # history as the codec state holds it: a view into a packed [batch, state_size] row.
    history = None
    if history_length:
        packed = random(batch, 7 + channels * history_length, dtype=dtype, generator=generator)
        history = packed[:, 7:].view(batch, channels, history_length)

    def to(t):
        return None if t is None else t.to(DEVICE)

    fused = kernels.snake_triton(to(x), to(log_alpha), to(log_beta), to(bias), to(history), tail)
    expected = kernels.snake_reference(
        x.float(),
        log_alpha,
        log_beta,
        None if bias is None else bias.float(),
        None if history is None else history.float(),
        tail,
    )
    assert fused.shape == (batch, channels, history_length + length + tail) and fused.dtype == dtype
    if history_length:  # the history is copied exactly
        assert torch.equal(fused[..., :history_length].cpu(), history)
    if tail:  # the tail is zeros, whatever the bias (a dilated convolution's padding)
        assert not fused[..., history_length + length :].cpu().any()
    tolerance = max(TOLERANCE[dtype], kernels.HARDWARE_SINE_TOLERANCE)
    torch.testing.assert_close(fused.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_channel_bias_matches_the_reference(dtype, with_residual):
    generator = torch.Generator().manual_seed(5 + with_residual)
    batch, channels, length = 3, 4, 1100
    # A trimmed view, as a convolution's output is.
    x = random(batch, channels, length + 9, dtype=dtype, generator=generator)[..., 4 : 4 + length]
    bias = random(channels, dtype=dtype, generator=generator)
    residual = random(batch, channels, length, dtype=dtype, generator=generator) if with_residual else None
    out = kernels.add_channel_bias_triton(
        x.to(DEVICE), bias.to(DEVICE), None if residual is None else residual.to(DEVICE)
    )
    expected = kernels.add_channel_bias_reference(
        x.float(), bias.float(), None if residual is None else residual.float()
    )
    assert out.is_contiguous() and out.shape == x.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


# A talker-like span and the code predictor's 16-entry cache, at the shipped launch shapes and at
# others benchmarks/attention_speed.py times (the interpreter ignores warps and stages).
ATTENTION_CASES = {
    "long span, shipped launch": (150, [70, 0, 149], None),
    "long span, 32-key blocks": (150, [70, 0, 149], (32, 4, 2)),
    "long span, 128-key blocks": (150, [70, 0, 149], (128, 8, 2)),
    "predictor span, shipped launch": (16, [15, 0, 6], None),
    "predictor span, 64-key blocks": (16, [15, 0, 6], (64, 4, 3)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens", [1, 2])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_matches_the_reference(dtype, new_tokens, case):
    """Rows at different positions (at the first entry, at the span's end and, for the long span,
    past a key block), over strided views of a larger cache, as StaticKV hands them out."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip(
            "Triton's interpreter (3.6 and 3.9) computes bf16 tl.dot wrongly (errors of 1e10); "
            "the GPU runs this case"
        )
    span, last_positions, launch = ATTENTION_CASES[case]
    generator = torch.Generator().manual_seed(new_tokens)
    batch, heads, kv_heads, dim = 3, 4, 2, 32
    last = torch.tensor(last_positions).clamp(min=new_tokens - 1)  # each row's last new position
    positions = last[:, None] - torch.arange(new_tokens - 1, -1, -1)[None, :]
    q = random(batch, heads, new_tokens, dim, dtype=dtype, generator=generator)
    cache = random(2, batch + 1, kv_heads, span + 10, dim, dtype=dtype, generator=generator)
    keys, values = cache[0, :batch, :, :span], cache[1, :batch, :, :span]
    out = attention.decode_attention(
        q.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), positions.to(DEVICE), 0.3, launch=launch
    )
    expected = attention.decode_attention_reference(q, keys, values, positions, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("new_tokens", [1, 2])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_over_an_fp8_cache_matches_the_reference(new_tokens, case):
    """FP8 keys and values with a scale per entry, over strided views of a larger cache and its scales
    (as StaticKV hands them out): fp32 queries here (Triton's interpreter computes bf16 tl.dot
    wrongly), bf16 ones, as served, on a GPU."""
    from voxtriton.kernels.fp8 import quantize_rows_reference

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    span, last_positions, launch = ATTENTION_CASES[case]
    generator = torch.Generator().manual_seed(20 + new_tokens)
    batch, heads, kv_heads, dim = 3, 4, 2, 32
    last = torch.tensor(last_positions).clamp(min=new_tokens - 1)
    positions = last[:, None] - torch.arange(new_tokens - 1, -1, -1)[None, :]
    q = random(batch, heads, new_tokens, dim, dtype=dtype, generator=generator)
    # Entries of magnitudes across two decades, so that the scales matter.
    magnitude = torch.logspace(-1, 1, span + 10)[None, None, None, :, None]
    cache, scales = quantize_rows_reference(
        random(2, batch + 1, kv_heads, span + 10, dim, generator=generator) * magnitude
    )
    keys, values = cache[0, :batch, :, :span], cache[1, :batch, :, :span]
    key_scales, value_scales = scales[0, :batch, :, :span, 0], scales[1, :batch, :, :span, 0]
    out = attention.decode_attention(
        *map(on_device, (q, keys, values, positions)),
        0.3,
        launch=launch,
        key_scales=on_device(key_scales),
        value_scales=on_device(value_scales),
    )
    expected = attention.decode_attention_reference(q, keys, values, positions, 0.3, key_scales, value_scales)
    assert out.shape == q.shape and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance * 10)


def test_the_code_predictors_span_is_the_longest_that_takes_the_short_launch():
    assert attention.launch_shape(16) == attention.launch_shape(1) == attention.SHORT_SPAN_LAUNCH
    assert attention.launch_shape(17) == attention.launch_shape(512) == attention.LONG_SPAN_LAUNCH
    assert attention.launch_shape(16, torch.float32) == attention.SHORT_SPAN_LAUNCH
    assert attention.launch_shape(17, torch.float32) == attention.LONG_SPAN_FP32_LAUNCH


def test_attention_speed_times_each_launch_shape_against_the_shipped_one(tmp_path):
    """benchmarks/attention_speed.py end to end (in Triton's interpreter without a GPU): it checks
    each swept shape's output against the shipped shape's before timing it, so a shape that
    computes something else fails the run."""
    out = tmp_path / "attention.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "benchmarks" / "attention_speed.py"),
            "--device",
            DEVICE.type,
            "--cases",
            "predictor_16",
            "--rows",
            "2",
            "--block-keys",
            "64",
            "--warps",
            "4",
            "--stages",
            "1",
            "--repeat",
            "20",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1" if DEVICE.type == "cpu" else "0"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["shipped"] == list(attention.SHORT_SPAN_LAUNCH) == [16, 2, 2]
    assert set(row["all"]) == {"16x2x2", "64x4x1"}  # the shipped shape and the swept one
    assert all(isinstance(us, float) and us > 0 for us in row["all"].values())
    itemsize = 4 if DEVICE.type == "cpu" else 2  # fp32 in the interpreter, bf16 on a GPU
    # 2 rows, 16 entries, keys and values.
    assert row["kv_mb"] == pytest.approx(2 * 16 * 8 * 128 * 2 * itemsize / 1e6)


# Triton's interpreter runs a row's sort in NumPy, seconds per row at 4096 tokens: the real
# vocabulary (3072, codebook 0) gets a few rows, a small one every mix of parameters.
SAMPLING_CASES = {
    "small vocabulary, every mix": (
        300,
        [(t, k, p) for t in (0.0, 0.7, 1.5) for k in (0, 1, 5, 300) for p in (1.0, 0.6, 0.1)],
    ),
    "codebook 0": (3072, [(0.0, 0, 1.0), (0.9, 50, 1.0), (1.0, 0, 0.8), (0.7, 3072, 0.3)]),
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampling_kernel_draws_the_reference_tokens(case):
    """Every mix of parameters a batch can hold, rows with masked (-inf) tokens and with ties at the
    top-k threshold: the kernel picks the tokens the reference formulas pick."""
    from voxtriton.engine.sampling import RowParams, noise_keys, sample
    from voxtriton.kernels.sampling import sample_triton

    vocab, settings = SAMPLING_CASES[case]
    generator = torch.Generator().manual_seed(vocab)
    batch = len(settings)
    # bf16 values: many ties.
    logits = random(batch, vocab, scale=4, generator=generator).to(torch.bfloat16).float()
    logits[::3, vocab // 2 :] = float("-inf")  # as codebook 0's suppressed control tokens are
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings))
    params = RowParams(temperature.float(), top_k.long(), top_p.float(), torch.arange(batch))
    # Keys for several groups, as a frame step makes them: a strided view per group; one row with
    # the largest key the hash makes (its token terms must not overflow).
    keys = noise_keys(params.seeds, torch.zeros(batch, 2, dtype=torch.long), torch.arange(2))
    keys[-1] = 2**31 - 1
    expected = sample(logits, params, keys[:, 1])

    def to(t):
        return t.to(DEVICE)

    drawn = sample_triton(
        to(logits), to(params.temperature), to(params.top_k), to(params.top_p), to(keys)[:, 1]
    )
    assert drawn.dtype == torch.int64
    assert torch.equal(drawn.cpu(), expected)
    # The filters matter here: without them the draws would differ.
    unfiltered = sample(
        logits,
        RowParams(params.temperature, torch.zeros_like(top_k), torch.ones(batch), params.seeds),
        keys[:, 1],
    )
    assert not torch.equal(unfiltered, expected)
    # And the noise matters: another group's keys draw other tokens.
    assert not torch.equal(
        sample_triton(
            to(logits), to(params.temperature), to(params.top_k), to(params.top_p), to(keys)[:, 0]
        ).cpu(),
        drawn.cpu(),
    )


def test_top_k_keeps_the_references_tokens_through_signs_zeros_and_ties():
    """The kernel's top-k threshold against the reference's: rows of negative and positive scores, both
    zeros, -inf and many ties, every k, each drawn with many keys, so that a token wrongly kept or
    dropped would show in some draw."""
    from voxtriton.engine.sampling import RowParams, sample
    from voxtriton.kernels.sampling import sample_triton

    generator = torch.Generator().manual_seed(11)
    vocab, keys_per_k = 40, 6
    values = torch.tensor([-3.5, -1.0, -0.0, 0.0, 0.25, 2.0, float("-inf")])
    row = values[torch.randint(len(values), (vocab,), generator=generator)]
    ks = list(range(1, vocab + 1))
    batch = len(ks) * keys_per_k
    logits = row.expand(batch, vocab).clone()
    top_k = torch.tensor(ks).repeat_interleave(keys_per_k)
    # Temperature 4 flattens the scores, so draws reach down to the threshold.
    seeds = torch.zeros(batch, dtype=torch.long)
    params = RowParams(torch.full((batch,), 4.0), top_k, torch.ones(batch), seeds)
    keys = torch.randint(0, 2**31 - 1, (batch,), generator=generator)
    expected = sample(logits, params, keys)
    drawn = sample_triton(*(t.to(DEVICE) for t in (logits, params.temperature, top_k, params.top_p, keys)))
    assert torch.equal(drawn.cpu(), expected)
    # The draws do reach past the top score: the threshold is exercised.
    assert len(set(expected.tolist())) > 4


def written_entries(shape: tuple[int, ...], positions: torch.Tensor) -> torch.Tensor:
    """[2, rows, kv_heads, length]: True where a layer call writes keys and values (row r at positions[r])."""
    written = torch.zeros(shape, dtype=torch.bool)
    for row, row_positions in enumerate(positions):
        written[:, row, :, row_positions] = True
    return written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "new_tokens, with_norm, heads, kv_heads", [(1, True, 4, 2), (2, True, 6, 2), (3, False, 3, 3)]
)
def test_rotate_into_cache_matches_the_reference(dtype, new_tokens, with_norm, heads, kv_heads):
    """q/k norms, the rotary embedding and the cache writes of one layer call: rows at different
    positions, positions as the predictor passes them (an expanded view), a cache that is a view of
    a larger one (its other rows and positions must stay as they were), and head counts whose total
    is not a power of two (the kernel pads its block of heads)."""
    from voxtriton.kernels import rotary
    from voxtriton.models.layers import Rotary

    generator = torch.Generator().manual_seed(new_tokens + 10 * with_norm)
    batch, dim, length = 3, 16, 20
    qkv = random(batch, new_tokens, heads + 2 * kv_heads, dim, scale=2, dtype=dtype, generator=generator)
    positions = torch.tensor([0, 7, length - new_tokens])[:, None] + torch.arange(new_tokens)[None, :]
    if new_tokens == 3:
        positions = torch.arange(new_tokens).expand(batch, new_tokens)
    cos, sin = Rotary(dim, 10000.0)(positions, dtype)
    norms = (
        [(random(dim, generator=generator) + 1).to(dtype) for _ in range(2)] if with_norm else [None, None]
    )
    cache = random(2, batch + 1, kv_heads, length + 3, dim, dtype=dtype, generator=generator)
    expected_cache, fused_cache = cache.clone(), cache.clone().to(DEVICE)
    expected = rotary.rotate_into_cache(
        qkv,
        heads,
        kv_heads,
        *norms,
        1e-6,
        cos,
        sin,
        expected_cache[0, :batch],
        expected_cache[1, :batch],
        positions,
    )

    def to(t):
        return None if t is None else t.to(DEVICE)

    fused = rotary.rotate_into_cache_triton(
        to(qkv),
        heads,
        kv_heads,
        *map(to, norms),
        1e-6,
        to(cos),
        to(sin),
        fused_cache[0, :batch],
        fused_cache[1, :batch],
        to(positions),
    )
    assert fused.shape == (batch, heads, new_tokens, dim) and fused.dtype == dtype
    # fp32 to within the sums' order; bf16 to one rounding step (Triton's interpreter truncates
    # where the GPU rounds to nearest).
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float().cpu(), expected.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(
        fused_cache.float().cpu(), expected_cache.float(), rtol=tolerance, atol=tolerance
    )
    written = written_entries(cache.shape[:4], positions)
    assert torch.equal(fused_cache.cpu()[~written], cache[~written])  # nothing else touched
    assert not torch.equal(fused_cache.cpu()[written], cache[written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens, with_norm", [(1, True), (2, False)])
def test_rotate_into_cache_writes_the_formulas_fp8_entries(dtype, new_tokens, with_norm):
    """An FP8 cache: the kernel writes the formula's bytes and scales, fp32 inputs in Triton's
    interpreter; elsewhere within one FP8 step (the interpreter rounds bf16 differently, and a GPU's
    fused multiply-adds and sum order may move the last bit before the FP8 rounding). An all-zero key
    and value stay zero with a finite scale, and nothing else is touched."""
    from voxtriton.kernels import rotary
    from voxtriton.kernels.fp8 import FP8
    from voxtriton.models.layers import Rotary

    generator = torch.Generator().manual_seed(30 + new_tokens)
    batch, heads, kv_heads, dim, length = 3, 4, 2, 16, 12
    qkv = random(batch, new_tokens, heads + 2 * kv_heads, dim, scale=3, dtype=dtype, generator=generator)
    qkv[1, 0, heads:] = 0.0  # row 1's first new token: every key and value head all zeros
    positions = torch.tensor([0, 5, length - new_tokens])[:, None] + torch.arange(new_tokens)[None, :]
    cos, sin = Rotary(dim, 10000.0)(positions, dtype)
    norms = (
        [(random(dim, generator=generator) + 1).to(dtype) for _ in range(2)] if with_norm else [None, None]
    )
    cache = random(2, batch + 1, kv_heads, length + 3, dim, generator=generator).to(FP8)
    scales = torch.rand(2, batch + 1, kv_heads, length + 3, generator=generator)
    expected_cache, expected_scales = cache.clone(), scales.clone()
    fused_cache, fused_scales = cache.clone().to(DEVICE), scales.clone().to(DEVICE)
    rows = slice(0, batch)
    inputs = (qkv, heads, kv_heads, *norms, 1e-6, cos, sin)
    expected = rotary.rotate_into_cache(
        *inputs, *expected_cache[:, rows], positions, *expected_scales[:, rows]
    )
    fused = rotary.rotate_into_cache_triton(
        *(on_device(t) if isinstance(t, torch.Tensor) else t for t in inputs),
        *fused_cache[:, rows],
        on_device(positions),
        *fused_scales[:, rows],
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float().cpu(), expected.float(), rtol=tolerance, atol=tolerance)
    fused_cache, fused_scales = fused_cache.cpu(), fused_scales.cpu()
    if dtype == torch.float32 and DEVICE.type == "cpu":
        assert torch.equal(fused_cache.view(torch.uint8), expected_cache.view(torch.uint8))
        assert torch.equal(fused_scales, expected_scales)
    else:
        torch.testing.assert_close(
            fused_cache.float() * fused_scales[..., None],
            expected_cache.float() * expected_scales[..., None],
            rtol=2**-3,
            atol=1e-3,
        )
    zero = (slice(None), 1, slice(None), positions[1, 0])
    assert torch.equal(fused_cache[zero].float(), torch.zeros(2, kv_heads, dim))
    assert ((fused_scales[zero] > 0) & (fused_scales[zero] < 1e-12)).all()
    written = written_entries(cache.shape[:4], positions)
    assert torch.equal(fused_cache[~written].view(torch.uint8), cache[~written].view(torch.uint8))
    assert torch.equal(fused_scales[~written], scales[~written])
    # Each written entry's largest magnitude is the format's largest value (all-zero ones aside).
    amax = fused_cache[written].float().abs().amax(dim=-1)
    assert ((amax == 448) | (amax == 0)).all() and (amax == 448).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1, 1000), (3, 2, 64)])
def test_add_rms_norm_matches_the_reference(dtype, shape):
    """A hidden size that is not a power of two (the kernel masks its block) and one that is, over
    several rows; the residual as a strided view (a slice of a wider stream)."""
    from voxtriton.kernels import norm

    generator = torch.Generator().manual_seed(shape[-1])
    x = random(*shape, scale=2, dtype=dtype, generator=generator)
    residual = random(*shape[:-1], shape[-1] + 8, scale=4, dtype=dtype, generator=generator)[..., 8:]
    weight = (random(shape[-1], generator=generator) + 1).to(dtype)
    expected_normed, expected_summed = norm.add_rms_norm_reference(x, residual, weight, 1e-6)
    normed, summed = norm.add_rms_norm_triton(x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE), 1e-6)
    assert normed.shape == summed.shape == shape and normed.dtype == summed.dtype == dtype
    # bf16 to one rounding step (Triton's interpreter truncates where the GPU rounds to nearest).
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(summed.float().cpu(), expected_summed.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(normed.float().cpu(), expected_normed.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1, 2 * 1000), (3, 2, 2 * 2500)])
def test_silu_and_mul_matches_the_reference(dtype, shape):
    """Intermediate sizes that are not a power of two: one column block partly masked, and several
    blocks with the up half starting inside one."""
    from voxtriton.kernels import norm

    generator = torch.Generator().manual_seed(shape[-1])
    gate_up = random(*shape, scale=3, dtype=dtype, generator=generator)
    expected = norm.silu_and_mul_reference(gate_up)
    out = norm.silu_and_mul_triton(gate_up.to(DEVICE))
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_columns, width", [(64, 1024), (70, 600), (6144, 512)])
@pytest.mark.parametrize("layout", ["last position", "every other column", "weight cut from a wider one"])
def test_one_row_linear_matches_the_reference(dtype, with_bias, out_columns, width, layout):
    """Sizes that fill every block, sizes that leave blocks partly masked, and a wide output (the
    wider block); x as the last position of a two-position row (as the predictor's first step hands
    its hidden state to its head), x with a stride along K, and a weight whose rows are further apart
    than they are long."""
    from voxtriton.kernels import linear

    generator = torch.Generator().manual_seed(out_columns + with_bias)
    x = random(1, 2, 2 * width, dtype=dtype, generator=generator)
    x = x[:, 0, ::2] if layout == "every other column" else x[:, -1, :width]
    weight = random(out_columns, width + 48, scale=width**-0.5, dtype=dtype, generator=generator)
    weight = weight[:, 48:] if layout == "weight cut from a wider one" else weight[:, :width].contiguous()
    bias = random(out_columns, dtype=dtype, generator=generator) if with_bias else None
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = linear.linear_triton(x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE))
    assert out.shape == (1, out_columns) and out.dtype == dtype
    # fp32 to within the sums' order; bf16 to one rounding step of the result.
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate, width", [(32, 1024), (35, 600), (3072, 512)])
@pytest.mark.parametrize("layout", ["last position", "weight cut from a wider one"])
def test_gated_one_row_linear_matches_silu_and_mul_of_the_product(dtype, intermediate, width, layout):
    """The gate/up product and its SiLU in one launch: both blocks (the gate/up weight of 6144 rows takes
    the wide one), intermediate sizes off the block multiples, and a weight with a row stride."""
    from voxtriton.kernels import linear, norm

    generator = torch.Generator().manual_seed(intermediate)
    x = random(1, 2, width, dtype=dtype, generator=generator)[:, -1]
    weight = random(2 * intermediate, width + 48, scale=2 * width**-0.5, dtype=dtype, generator=generator)
    weight = weight[:, 48:] if layout == "weight cut from a wider one" else weight[:, :width].contiguous()
    expected = norm.silu_and_mul_reference(torch.nn.functional.linear(x.float(), weight.float()))
    out = linear.linear_triton(x.to(DEVICE), weight.to(DEVICE), None, gated=True)
    assert out.shape == (1, intermediate) and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)
    # The halves are not interchangeable: swapping them changes the result.
    swapped = torch.cat((weight[intermediate:], weight[:intermediate]))
    swapped_out = linear.linear_triton(x.to(DEVICE), swapped.to(DEVICE), None, gated=True)
    assert not torch.allclose(swapped_out.cpu(), out.cpu())
    with pytest.raises(ValueError, match="even number of weight rows"):
        linear.linear_triton(x.to(DEVICE), weight[1:].to(DEVICE), None, gated=True)


def test_linear_takes_the_kernel_for_one_bf16_row_on_a_gpu_only():
    """One bf16 row on a GPU that runs the kernel goes to it; two rows, an fp32 row, a weight without
    unit stride along K or a CPU tensor to F.linear, with its result."""
    from voxtriton.kernels import check_kernels, linear

    generator = torch.Generator().manual_seed(11)
    weight = on_device(random(32, 256, dtype=torch.bfloat16, generator=generator))
    rows = on_device(random(2, 1, 256, dtype=torch.bfloat16, generator=generator))
    check_kernels(DEVICE)  # as the runners do at start: the checks' own launches are not counted below
    calls = []

    def record(*args, **kwargs):
        calls.append(args)

    linear._one_row_kernel.add_pre_run_hook(record)
    try:
        transposed = weight.t().contiguous().t()
        for x, w in ((rows, weight), (rows[:1].float(), weight.float()), (rows[:1], transposed)):
            torch.testing.assert_close(linear.linear(x, w), torch.nn.functional.linear(x, w), rtol=0, atol=0)
        assert calls == []
        out = linear.linear(rows[:1], weight)
    finally:
        linear._one_row_kernel.pre_run_hooks.remove(record)
    assert out.shape == (1, 1, 32)
    assert len(calls) == (1 if DEVICE.type == "cuda" else 0)


def test_one_row_linear_compiles_once_for_every_row_it_is_handed():
    """A decode step's row, the last position of a longer input and a row at any offset of a wider
    tensor share the variant compiled at warm-up (per weight shape and bias)."""
    from voxtriton.kernels import linear

    generator = torch.Generator().manual_seed(12)
    width = 256
    weight = on_device(random(64, width, dtype=torch.bfloat16, generator=generator))
    wide = on_device(random(3, 2 * width + 1, dtype=torch.bfloat16, generator=generator))

    def launches():
        linear.linear_triton(wide[:1, :width].contiguous(), weight, None)  # a decode step's row
        linear.linear_triton(wide[:, :width].reshape(1, 3, width)[:, -1], weight, None)  # a last position
        for start in (1, 3, 8):  # 2, 6 and 16 bytes in
            linear.linear_triton(wide[1:2, start : start + width], weight, None)

    assert len(compiled_variants(linear._one_row_kernel, launches)) == 1


def test_turn_off_lets_the_formula_serve_and_refuses_unknown_names():
    """What `model_speed.py --kernels-off` measures with: a named kernel stops serving on a GPU (and
    nothing changes on a CPU, where formulas serve anyway); a name no kernel has is refused."""
    from voxtriton.kernels import registry

    with pytest.raises(KeyError, match="no Triton kernel named .'one_row_linearr'."):
        registry.turn_off(DEVICE, ["one_row_linearr"])
    was_usable = registry.triton_usable(DEVICE, "one_row_linear")
    registry.turn_off(DEVICE, ["one_row_linear"])
    try:
        assert not registry.triton_usable(DEVICE, "one_row_linear")
        assert registry.triton_usable(DEVICE, "silu_and_mul") == (DEVICE.type == "cuda")
    finally:
        if DEVICE.type == "cuda":
            registry.check_kernels(DEVICE)["one_row_linear"] = was_usable


def test_plain_launches_hold_in_their_own_thread_only(monkeypatch):
    """`plain_launches` (the codec's runner): no dependent launches inside it, in the thread that
    entered it; another thread meanwhile, and the same one after it, launch as the device allows
    (here a device that allows them: the registry's answer for Hopper)."""
    import threading

    from voxtriton.kernels import registry

    monkeypatch.setattr(registry, "triton_usable", lambda device, kernel: kernel == "programmatic_launch")
    answers = {}
    entered, checked = threading.Event(), threading.Event()

    def other_thread():
        entered.wait(10)
        answers["other thread"] = registry.programmatic_launch(DEVICE)
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with registry.plain_launches():
        answers["inside"] = registry.programmatic_launch(DEVICE)
        entered.set()
        assert checked.wait(10)
    thread.join()
    answers["after"] = registry.programmatic_launch(DEVICE)
    assert answers == {"inside": False, "other thread": True, "after": True}


def test_the_environment_turns_named_kernels_off_and_refuses_unknown_names(monkeypatch):
    """VOXTRITON_KERNELS_OFF: what a server's model instances read to serve a kernel's formula. A name
    no kernel has stops the start on every device, naming the variable; a known one is off on a GPU
    when its device is first checked, the others checked as before."""
    from voxtriton.kernels import registry

    index = torch.cuda.current_device() if DEVICE.type == "cuda" else None
    checked = registry._usable.pop(index, None)  # the variable is read when a device is first checked
    try:
        monkeypatch.setenv("VOXTRITON_KERNELS_OFF", "one_row_linear, silu_and_mull")
        with pytest.raises(KeyError, match="VOXTRITON_KERNELS_OFF: no Triton kernel named .'silu_and_mull'."):
            registry.check_kernels(DEVICE)
        monkeypatch.setenv("VOXTRITON_KERNELS_OFF", "one_row_linear")
        if DEVICE.type != "cuda":
            assert not any(registry.check_kernels(DEVICE).values())
            return
        usable = registry.check_kernels(torch.device("cuda", index))
        assert usable["one_row_linear"] is False and usable["silu_and_mul"] is True
        assert set(usable) == set(registry.KERNEL_CHECKS)
    finally:
        registry._usable.pop(index, None)
        if checked is not None:
            registry._usable[index] = checked


def test_each_kernel_check_decides_for_its_kernel_alone(caplog):
    """The startup checks: every kernel we ship agrees with its formula here, and a kernel that fails
    to build or disagrees falls back alone, with a warning naming it and why."""
    from voxtriton.kernels.registry import KERNEL_CHECKS, run_checks

    # Triton's interpreter computes bf16 tl.dot wrongly (see above) and runs no inline assembly (the
    # programmatic launch's); the GPU runs those checks.
    shipped = {
        name: check
        for name, check in KERNEL_CHECKS.items()
        if DEVICE.type == "cuda"
        or name not in ("decode_attention", "decode_attention_fp8", "programmatic_launch")
    }

    def fails_to_build(device):
        raise RuntimeError("no C compiler")

    def disagrees(device):
        return [(torch.zeros(3), torch.ones(3), 1e-5)]

    usable = run_checks(DEVICE, {**shipped, "fails_to_build": fails_to_build, "disagrees": disagrees})
    assert usable == {**dict.fromkeys(shipped, True), "fails_to_build": False, "disagrees": False}
    assert "Triton kernel fails_to_build unavailable" in caplog.text and "no C compiler" in caplog.text
    assert (
        "Triton kernel disagrees unavailable" in caplog.text and "disagrees with its reference" in caplog.text
    )


@pytest.mark.parametrize("first", ["voxtriton.kernels", "voxtriton.engine.model_runner"])
def test_every_kernel_registers_its_check_and_the_kernels_import_no_engine(first):
    """Whichever module a fresh process imports first, every kernel's startup check is registered;
    the kernels package imports nothing from the engine (the engine imports the kernels, not back)."""
    script = (
        f"import json, sys, {first}\n"
        "from voxtriton.kernels.registry import KERNEL_CHECKS\n"
        "engine = [m for m in sys.modules if m.startswith('voxtriton.engine')]\n"
        "print(json.dumps([sorted(KERNEL_CHECKS), engine]))\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    checks, engine_modules = json.loads(completed.stdout)
    assert checks == [
        "add_rms_norm",
        "channel_bias",
        "decode_attention",
        "decode_attention_fp8",
        "fp8_quantize_rows",
        "one_row_linear",
        "programmatic_launch",
        "rotary",
        "rotary_fp8",
        "sampling",
        "silu_and_mul",
        "snake",
    ]
    assert (engine_modules == []) is (first == "voxtriton.kernels")


def compiled_variants(kernel, launch) -> set:
    """The compiled variants of `kernel` that the launches `launch()` makes select. Triton compiles one
    per distinct specialisation of the arguments (dtypes; pointers aligned to 16 bytes or not; ints
    equal to 1, divisible by 16 or neither; constexprs), at its first launch, on the launching thread:
    a variant first met while serving stalls every stream for the compile (a second or more)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction

    # Triton's interpreter (CPU) keeps the decorator's arguments; the JIT function reads them.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    constexprs = {p.name for p in jit.params if p.is_constexpr}
    variants = set()

    def record(*args, **kwargs):
        assert len(args) == len(jit.params) - len(constexprs), "launch with every runtime argument positional"
        arguments = [
            native_specialize_impl(
                BaseBackend, arg, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
            )
            for p, arg in zip(jit.params, args)
        ]
        options = {k: v for k, v in kwargs.items() if k in constexprs or k in ("num_warps", "num_stages")}
        variants.add((tuple(arguments), tuple(sorted(options.items()))))

    kernel.add_pre_run_hook(record)
    try:
        launch()
    finally:
        kernel.pre_run_hooks.remove(record)
    return variants


def test_sampling_outside_graphs_reuses_the_graphs_compiled_kernel():
    """Admissions sample their first code eagerly, for rows anywhere in the batch (any alignment of
    the per-row parameters) and keys cut from a wider tensor; the frame step's graph captured the
    kernel for rows from 0. All of them must select one compiled variant."""
    from voxtriton.kernels import sampling

    generator = torch.Generator().manual_seed(8)
    rows, vocab = 8, 300
    temperature, top_p = torch.rand(rows, generator=generator) + 0.5, torch.rand(rows, generator=generator)
    top_k = torch.randint(0, 50, (rows,), generator=generator)
    keys = torch.randint(0, 2**31 - 1, (rows, 4), generator=generator)
    temperature, top_p, top_k, keys = map(on_device, (temperature, top_p, top_k, keys))

    def launches():
        for first in range(4):
            for count in (1, 3):
                part = slice(first, first + count)
                logits = on_device(torch.randn(count, vocab, generator=generator))
                for draw_keys in (keys[part, 0], keys[part, 1].contiguous()):
                    sampling.sample_triton(logits, temperature[part], top_k[part], top_p[part], draw_keys)

    assert len(compiled_variants(sampling._sample_kernel, launches)) == 1


def test_rotary_kernel_compiles_once_for_every_prompt_length():
    """Decode steps (one new token) and prefills of any prompt length, graph-captured or eager, share
    one compiled variant of the rotary kernel (the new-token count is a runtime value)."""
    from voxtriton.kernels import rotary
    from voxtriton.models.layers import Rotary

    generator = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, span = 4, 2, 16, 64
    norms = [on_device(torch.rand(dim, generator=generator) + 0.5) for _ in range(2)]
    cache = on_device(torch.zeros(2, 3, kv_heads, span, dim))
    embedding = Rotary(dim, 10000.0).to(DEVICE)

    def launches():
        for new_tokens in (1, 2, 16, 17, 33):
            for batch in (1, 3):
                qkv = on_device(
                    torch.randn(batch, new_tokens, heads + 2 * kv_heads, dim, generator=generator)
                )
                positions = on_device(torch.arange(new_tokens)[None, :].repeat(batch, 1))
                cos, sin = embedding(positions, torch.float32)
                rotary.rotate_into_cache_triton(
                    qkv,
                    heads,
                    kv_heads,
                    *norms,
                    1e-6,
                    cos,
                    sin,
                    cache[0, :batch],
                    cache[1, :batch],
                    positions,
                )

    assert len(compiled_variants(rotary._rotate_into_cache_kernel, launches)) == 1


# Checks whose kernels need more than the named GPU has, as their startup checks say on one.
NEEDS_NEWER = {
    80: {"fp8_quantize_rows": "fp8e4nv", "decode_attention_fp8": "fp8e4nv", "rotary_fp8": "fp8e4nv"},
    89: {},
    90: {},
}
# Shared memory a program may take (bytes): A100, Ada, H100.
SHARED_MEMORY = {80: 166912, 89: 101376, 90: 232448}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
@pytest.mark.parametrize("capability, dependent_launches", [(80, False), (89, False), (90, True)])
def test_every_kernel_compiles_for_the_gpus_it_serves_on(tmp_path, capability, dependent_launches):
    """Triton's GPU compiler and ptxas build every kernel that the startup checks launch, for Ampere,
    Ada and Hopper (with programmatic dependent launches), within each GPU's shared memory: the
    interpreter that runs the other kernel tests on a CPU accepts code the GPU compiler refuses.
    Only kernels that need a newer GPU fail, and only there."""
    report = tmp_path / "report.json"
    root = str(Path(__file__).parents[1])
    environment = {
        **{k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"},  # Triton's own ptxas
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),  # compiled here, not found cached
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_kernels.py")), str(capability), str(report)]
        + (["--dependent-launches"] if dependent_launches else []),
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report.read_text())
    expected_failures = dict(NEEDS_NEWER[capability])
    if not dependent_launches:
        expected_failures["programmatic_launch"] = "requires .target sm_90"
    for name, error in report["errors"].items():
        if name in expected_failures:
            assert error is not None and expected_failures[name] in error, (name, error)
        else:
            assert error is None, f"{name} does not compile for compute capability {capability}: {error}"
    too_large = {k: v for k, v in report["shared"].items() if v > SHARED_MEMORY[capability]}
    assert too_large == {}, f"shared memory per program over {SHARED_MEMORY[capability]} bytes"

    import voxtriton.kernels as package

    launched = {
        name
        for module in (getattr(package, m.name) for m in pkgutil.iter_modules(package.__path__))
        for name, value in vars(module).items()
        if name.endswith("_kernel") and hasattr(value, "fn")
    }
    assert set(report["shared"]) == launched - ({"_quantize_rows_kernel"} if capability < 89 else set())
