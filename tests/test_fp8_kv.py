"""The FP8 KV cache (`fp8_kv_cache`): the setting and its refusals, what the runner stores, the error
against the bf16 cache, and the engine's batching properties with it. Runs on the CPU (the PyTorch
formulas) and on a GPU (the kernels); tests/test_kernels.py holds the kernels against the formulas.
Random-weight checkpoints: the codes are noise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_engine import make_request, run
from test_fp8 import assert_the_server_streams_the_in_process_codes

from voxtriton.bench import fidelity
from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.kernels.fp8 import FP8, quantize_rows_reference
from voxtriton.models.config import load_config
from voxtriton.models.families import load_family
from voxtriton.models.fp8 import check_fp8_device, fp8_kv_runner_options
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.settings import FP8_KV_CACHE, TTSSettings

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the server's (dtype auto)
FRAMES, PROMPTS = 24, 4


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    config = load_config(tiny_checkpoint)
    return (
        config,
        load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=DTYPE),
        PromptBuilder(config, TextTokenizer(tiny_checkpoint)),
    )


def test_the_setting_is_off_by_default_and_a_bad_value_names_it():
    def parse(value):
        return TTSSettings.from_model_config({"parameters": {"fp8_kv_cache": {"string_value": value}}})[0]

    assert TTSSettings().fp8_kv_cache == "off"
    assert [parse(value).fp8_kv_cache for value in FP8_KV_CACHE] == ["off", "talker", "on"]
    with pytest.raises(ValueError, match="parameter 'fp8_kv_cache' must be off, talker or on, got 'true'"):
        parse("true")


def test_a_family_without_the_path_is_refused_by_name(tiny_checkpoint):
    family = load_family(tiny_checkpoint)
    assert family.fp8_kv_cache
    assert fp8_kv_runner_options(family, "off") == {}
    assert fp8_kv_runner_options(family, "talker") == {"fp8_kv_cache": "talker"}
    assert fp8_kv_runner_options(family, "on") == {"fp8_kv_cache": "on"}
    other = dataclasses.replace(family, name="other", fp8_kv_cache=False)
    assert fp8_kv_runner_options(other, "off") == {}
    with pytest.raises(
        ValueError, match="fp8_kv_cache: an FP8 KV cache is for Qwen3-TTS checkpoints, not other"
    ):
        fp8_kv_runner_options(other, "talker")


def test_a_gpu_without_fp8_is_refused_naming_the_setting(monkeypatch):
    """What the runner checks before it allocates an FP8 cache; the GPU's answers stand in for an A100."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(
        ValueError,
        match=r"fp8_kv_cache: FP8 keys and values need a GPU of compute capability 8.9 .* A100 is 8.0",
    ):
        check_fp8_device(torch.device("cuda", 0), "fp8_kv_cache", "FP8 keys and values")


@pytest.mark.parametrize("setting", ["talker", "on"])
def test_the_runner_stores_the_quantised_entries_and_their_scales(setup, setting):
    """After a prefill, the talker's first-layer entries (computed before any attention reads the cache)
    are exactly the quantised entries of the unquantised cache, each with its scale; the predictor's
    cache is FP8 with `on` only, and positions past the prompts stay zero."""
    config, backbone, prompts = setup
    requests = [make_request(setup, i) for i in range(2)]
    runners = [ModelRunner(backbone, 2, 64, 64, fp8_kv_cache=value) for value in ("off", setting)]
    for runner in runners:
        runner.prefill(requests, 0)
    plain, fp8 = (runner.cache for runner in runners)
    assert plain.key_scales is None and fp8.keys.dtype == FP8 and fp8.values.dtype == FP8
    assert fp8.key_scales.shape == fp8.keys.shape[:-1] and fp8.key_scales.dtype == torch.float32
    assert runners[1].predictor_cache.fp8 is (setting == "on")
    lengths = [len(request.prompt.text_ids) for request in requests]
    longest = max(lengths)
    for entries, scales, unquantised in (
        (fp8.keys, fp8.key_scales, plain.keys),
        (fp8.values, fp8.value_scales, plain.values),
    ):
        expected, expected_scales = quantize_rows_reference(unquantised[0, :, :, :longest])
        assert torch.equal(entries[0, :, :, :longest].view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(scales[0, :, :, :longest], expected_scales[..., 0])
    for row, length in enumerate(lengths):  # each entry's largest magnitude maps to 448
        assert fp8.keys[:, row, :, :length].float().abs().amax(-1).eq(448).all()
    assert not fp8.keys[:, :, :, longest:].float().any() and not fp8.key_scales[:, :, :, longest:].any()


@pytest.mark.parametrize("setting", ["talker", "on"])
def test_fp8_kv_logits_stay_close_to_bf16_and_codes_are_measured(tiny_checkpoint, setup, setting):
    """Teacher-forced over FRAMES frames of PROMPTS prompts, every codebook's logit error is bounded
    (asserted; measured values are printed). Free-running greedy codes: the share that agrees is
    printed, not asserted: random weights give near-flat logits, so one flipped argmax sends a prompt
    down another path (fp8_check.py measures the 1.7B)."""
    config, reference, prompts = setup
    candidate = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=DTYPE)  # hooks per model
    requests = fidelity.greedy_requests(reference, prompts, FRAMES, PROMPTS)
    positions = fidelity.positions_needed(requests, FRAMES)
    report = fidelity.teacher_forced_logit_error(
        fidelity.new_runner(reference, PROMPTS, positions, graphs=False),
        fidelity.new_runner(candidate, PROMPTS, positions, graphs=False, fp8_kv_cache=setting),
        requests,
        FRAMES,
    )
    assert [row["codebook"] for row in report] == list(range(16))
    for row in report:
        assert 0 < row["mean_abs_error_rel"] < 0.05, row
        assert row["max_abs_error_rel"] < 0.25, row
    codes = [
        fidelity.decode_frames(
            fidelity.new_runner(reference, PROMPTS, positions, graphs=False, fp8_kv_cache=value),
            fidelity.greedy_requests(reference, prompts, FRAMES, PROMPTS),
            FRAMES,
        )
        for value in ("off", setting)
    ]
    agreement = fidelity.code_agreement(*codes)
    print(
        f"tiny checkpoint (random weights), {PROMPTS} prompts x {FRAMES} frames, fp8_kv_cache={setting} "
        f"against off: "
        f"teacher-forced mean error / mean magnitude "
        f"{[round(row['mean_abs_error_rel'], 4) for row in report]}, top-1 agreement "
        f"{[round(row['top1_agreement'], 3) for row in report]}; free-running codes agree "
        f"{agreement['all_codebooks']:.3f}, first difference per prompt {agreement['first_difference']}"
    )


def new_engine(setup, rows=8, overlap=False, buckets=False):
    runner = ModelRunner(setup[1], max_rows=rows, max_positions=512, max_text_tokens=64, fp8_kv_cache="on")
    if buckets:
        runner.set_buckets([], [], prefill_batch_sizes=[1, 2], prefill_lengths=[16, 32])
    return Engine(runner, max_running=rows, overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlap"])
def test_with_fp8_kv_requests_joining_a_batch_get_the_codes_they_get_alone(setup, overlap):
    """Quantisation is per entry, so a request's codes do not depend on its neighbours, on the step it
    joins at, on its row (rows move as others finish) or on prefill padding."""
    alone = {}
    for i in range(4):
        alone.update(run(new_engine(setup), {0: [make_request(setup, i, frames=10 + 3 * i)]}))
    arrivals = {
        0: [make_request(setup, 0, 10)],
        2: [make_request(setup, 1, 13)],
        3: [make_request(setup, 2, 16), make_request(setup, 3, 19)],
    }
    together = run(new_engine(setup, overlap=overlap, buckets=True), arrivals)
    assert together.keys() == alone.keys()
    for request_id, codes in alone.items():
        np.testing.assert_array_equal(together[request_id], codes)


@pytest.mark.server
def test_a_server_with_an_fp8_kv_cache_streams_the_in_process_codes(tiny_checkpoint, setup):
    """`tts:fp8_kv_cache=on` through a real tritonserver: a greedy request's codes are those the
    runner with an FP8 KV cache decodes in process."""
    _, backbone, prompts = setup
    log = assert_the_server_streams_the_in_process_codes(
        tiny_checkpoint, backbone, prompts, {"fp8_kv_cache": "on"}, fp8_kv_cache="on"
    )
    assert "FP8 KV cache (on)" in log
