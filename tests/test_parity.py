"""Numerical parity with the official implementation (PyPI `qwen-tts-hf`) on one random checkpoint.

Both sides load the same files from disk. Logits must agree to a relative error of 1e-4 (fp32),
greedy decoding must give identical codes, and the codec must give the same waveform.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_or_skip

from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_backbone, load_codec
from voxtriton.models.text import PromptBuilder, TextTokenizer

FRAMES = 24
TEXT = "Hello world, this is a parity test of the talker."


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def load_reference(checkpoint):
    qwen_tts = require_or_skip("qwen_tts", "the parity tests need the official qwen-tts-hf package")
    return qwen_tts.Qwen3TTSModel.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager"
    )


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return load_reference(tiny_checkpoint)


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_ours(tiny_checkpoint)


def load_ours(checkpoint):
    """(config, backbone, prompt builder) of a checkpoint."""
    config = load_config(checkpoint)
    return config, load_backbone(checkpoint, config), PromptBuilder(config, TextTokenizer(checkpoint))


class LogitRecorder:
    """Forward hooks that record every logits tensor a module produces (last position only)."""

    def __init__(self, modules):
        self.calls: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._record) for m in modules]

    def _record(self, module, args, output):
        logits = output.logits if hasattr(output, "logits") else output
        self.calls.append(logits.detach().reshape(-1, logits.shape[-1])[-1].clone())

    def close(self):
        for handle in self.handles:
            handle.remove()


def record_reference(reference, generate):
    """Run `generate()` (a greedy official generation) and record: (the codes it decodes [frames, 16],
    talker logits, predictor logits, what `generate` returned)."""
    talker = reference.model.talker
    talker_rec = LogitRecorder([talker])
    predictor_rec = LogitRecorder([talker.code_predictor])
    captured = {}
    decode = reference.model.speech_tokenizer.decode

    def keep_codes(encoded):
        captured["codes"] = encoded[0]["audio_codes"].numpy()
        return decode(encoded)

    reference.model.speech_tokenizer.decode = keep_codes
    try:
        result = generate()
    finally:
        reference.model.speech_tokenizer.decode = decode
        talker_rec.close()
        predictor_rec.close()
    return captured["codes"], talker_rec.calls, predictor_rec.calls, result


def run_reference(reference, instruct=None, interleaved=False):
    """Greedy reference generation: (codes [frames, 16], talker logits, predictor logits)."""
    codes, talker_calls, predictor_calls, _ = record_reference(
        reference,
        lambda: reference.generate_custom_voice(
            text=TEXT,
            speaker="ryan",
            language="english",
            instruct=instruct,
            non_streaming_mode=not interleaved,
            do_sample=False,
            subtalker_dosample=False,
            max_new_tokens=FRAMES + 1,
        ),
    )
    return codes, talker_calls, predictor_calls


def record_ours(config, backbone, prompt, frames: int = FRAMES):
    """Greedy generation of one prompt by our engine: (codes [frames, 16], talker and predictor logits)."""
    talker = backbone.talker
    talker_rec = LogitRecorder([talker.codec_head])
    predictor_rec = LogitRecorder(list(talker.code_predictor.lm_head))
    engine = Engine(ModelRunner(backbone, max_rows=2, max_positions=256, max_text_tokens=64), max_running=2)
    params = GenerationParams.create(config.generation, 1000, temperature=0.0, max_frames=frames, seed=0)
    engine.add(Request("parity", prompt, params))
    codes = []
    while engine.has_work:
        codes += [output.codes for output in engine.step()]
    talker_rec.close()
    predictor_rec.close()
    return np.stack(codes), talker_rec.calls, predictor_rec.calls


def run_ours(ours, instruct=None, interleaved=False):
    config, backbone, prompts = ours
    return record_ours(config, backbone, prompts.build(TEXT, "ryan", "english", instruct, interleaved))


@pytest.mark.parametrize(
    "instruct,interleaved",
    [(None, False), (None, True), ("Speak slowly and warmly.", False)],
    ids=["full-text", "interleaved-text", "instruct"],
)
def test_greedy_codes_and_logits_match_reference(reference, ours, instruct, interleaved):
    assert_same_generation(
        run_ours(ours, instruct, interleaved), run_reference(reference, instruct, interleaved)
    )


def assert_same_generation(ours, reference, frames: int = FRAMES) -> None:
    """(codes, talker logits, predictor logits) of our engine and of the reference agree."""
    (our_codes, our_talker, our_predictor), (ref_codes, ref_talker, ref_predictor) = ours, reference
    assert ref_codes.shape == (frames, 16)
    np.testing.assert_array_equal(our_codes, ref_codes)
    # The talker ran once per frame plus the prefill; the predictor 15 times per frame.
    assert len(our_talker) >= frames and len(our_predictor) == 15 * frames
    for step, (mine, theirs) in enumerate(zip(our_talker, ref_talker)):
        assert relative_error(mine, theirs) <= 1e-4, f"talker logits differ at step {step}"
    for step, (mine, theirs) in enumerate(zip(our_predictor, ref_predictor)):
        assert relative_error(mine, theirs) <= 1e-4, f"code-predictor logits differ at call {step}"


def test_prompt_tokens_match_reference_processor(reference, ours):
    _, _, prompts = ours
    template = f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    ids = reference.processor(text=template, return_tensors="pt")["input_ids"][0].tolist()
    prompt = prompts.build(TEXT, "ryan", "english", interleaved=True)
    assert prompt.text_ids[:3] == ids[:3]
    assert [prompt.text_ids[-1]] + prompt.trailing_text_ids[:-1] == ids[3:-5]


def test_codec_waveform_matches_reference(reference, tiny_checkpoint):
    codec = load_codec(tiny_checkpoint)
    codes = torch.randint(0, 2048, (90, 16), generator=torch.Generator().manual_seed(3))
    wavs, rate = reference.model.speech_tokenizer.decode([{"audio_codes": codes}])
    assert rate == 24000
    ours, _ = codec.decode(codes[None], torch.zeros(1, dtype=torch.long), codec.new_state(1))
    expected = torch.from_numpy(wavs[0])
    assert ours.shape == (1, 90 * 1920)
    assert expected.abs().max() > 0.05  # a real signal, not silence
    assert (ours[0] - expected).abs().max().item() <= 1e-4
