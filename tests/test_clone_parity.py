"""Voice cloning with a Base checkpoint: parity with the official implementation (`qwen-tts-hf`).

Both sides load the same random tiny-base checkpoint (random weights: the audio is noise). The
x-vector and the reference codes must match, greedy generation must give identical codes and logits
in both prompt modes (x-vector only; in-context with reference text and codes) and both text layouts,
and the audio streamed chunk by chunk after the reference codes must equal the reference's decode.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import require_or_skip
from test_parity import (
    assert_same_generation,
    load_ours,
    load_reference,
    record_ours,
    record_reference,
    relative_error,
)

from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.loader import load_codec, load_speaker_encoder, load_speech_encoder
from voxtriton.models.random_checkpoint import PRESET_DIR, checkpoint_shapes, preset_configs
from voxtriton.models.voice import Voice

FRAMES = 20
TEXT = "Hello world, this is a cloned voice."
REFERENCE_TEXT = "This is the reference recording."


def reference_audio(seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """A voiced-like test signal: harmonics of a gliding pitch plus a little noise, 24 kHz."""
    t = np.arange(int(24000 * seconds)) / 24000
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 24000
    wave = sum(np.sin(k * phase) / k for k in range(1, 6))
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.25 * wave + 0.01 * noise).astype(np.float32)


@pytest.fixture(scope="module")
def reference(tiny_base_checkpoint):
    return load_reference(tiny_base_checkpoint)


@pytest.fixture(scope="module")
def ours(tiny_base_checkpoint):
    config, backbone, prompts = load_ours(tiny_base_checkpoint)
    encoders = (
        load_speaker_encoder(tiny_base_checkpoint, config),
        load_speech_encoder(tiny_base_checkpoint, config),
    )
    return config, backbone, prompts, *encoders


def our_voice(ours, audio: np.ndarray, text: str | None) -> Voice:
    *_, speaker_encoder, speech_encoder = ours
    with torch.inference_mode():
        embedding = speaker_encoder(torch.from_numpy(audio)[None])[0]
        codes = speech_encoder(torch.from_numpy(audio)[None])[0]
    return Voice(embedding.numpy(), codes.numpy(), text)


def test_reference_loads_every_tensor_we_write(reference, tiny_base_checkpoint):
    from safetensors import safe_open

    with safe_open(str(tiny_base_checkpoint / "model.safetensors"), "pt") as talker_file:
        for name, param in reference.model.speaker_encoder.named_parameters():
            assert torch.equal(param, talker_file.get_tensor(f"speaker_encoder.{name}").float()), name
    tokenizer = reference.model.speech_tokenizer.model
    with safe_open(str(tiny_base_checkpoint / "speech_tokenizer" / "model.safetensors"), "pt") as speech:
        state = tokenizer.encoder.state_dict()
        assert len(state) > 100
        for name, value in state.items():
            assert torch.equal(value.float(), speech.get_tensor(f"encoder.{name}").float()), name


@pytest.mark.parametrize("seconds", [1.0, 2.5])
def test_speaker_embedding_and_reference_codes_match(reference, ours, seconds):
    audio = reference_audio(seconds)
    voice = our_voice(ours, audio, None)
    theirs = reference.model.extract_speaker_embedding(audio, 24000)
    assert theirs.abs().max() > 0.1  # a real vector, not zeros
    assert relative_error(torch.from_numpy(voice.embedding), theirs) <= 1e-5
    codes = reference.model.speech_tokenizer.encode(audio, sr=24000).audio_codes[0]
    assert voice.codes.shape == (int(np.ceil(seconds * 12.5)), 16)
    np.testing.assert_array_equal(voice.codes, codes.numpy())


def run_reference(reference, audio, ref_text, interleaved):
    """Greedy reference cloning: (decoded codes, talker logits, predictor logits, waveform)."""
    codes, talker_calls, predictor_calls, (wavs, _) = record_reference(
        reference,
        lambda: reference.generate_voice_clone(
            text=TEXT,
            language="english",
            ref_audio=(audio, 24000),
            ref_text=ref_text,
            x_vector_only_mode=ref_text is None,
            non_streaming_mode=not interleaved,
            do_sample=False,
            subtalker_dosample=False,
            max_new_tokens=FRAMES + 1,
        ),
    )
    return codes, talker_calls, predictor_calls, wavs[0]


def run_ours(ours, voice, interleaved):
    config, backbone, prompts, *_ = ours
    prompt = prompts.build(TEXT, None, "english", interleaved=interleaved, voice=voice)
    return record_ours(config, backbone, prompt, FRAMES)


def stream_audio(codec, codes: np.ndarray, prime: np.ndarray | None, schedule=(2, 2, 4, 4, 8)) -> np.ndarray:
    """Decode like the server: the reference codes first (their audio dropped), then chunk by chunk."""
    state, start, pieces = codec.new_state(1), 0, []
    if prime is not None:
        _, state = codec.decode(torch.from_numpy(prime)[None], torch.zeros(1, dtype=torch.long), state)
        start = len(prime)
    done = 0
    for size in list(schedule) + [len(codes)]:
        chunk = torch.from_numpy(codes[done : done + size])[None]
        if chunk.shape[1] == 0:
            break
        wav, state = codec.decode(chunk, torch.tensor([start + done]), state)
        pieces.append(wav[0])
        done += chunk.shape[1]
    return torch.cat(pieces).numpy()


@pytest.mark.parametrize(
    "ref_text,interleaved,seconds",
    [
        (None, False, 2.0),
        (None, True, 2.0),
        (REFERENCE_TEXT, False, 2.0),
        (REFERENCE_TEXT, True, 2.0),  # more reference frames than text: the text is padded
        (REFERENCE_TEXT + " " + TEXT, True, 1.0),  # more text than frames: its tail trails
    ],
    ids=["x-vector", "x-vector-interleaved", "in-context", "in-context-interleaved", "in-context-long-text"],
)
def test_greedy_cloning_matches_reference(
    reference, ours, tiny_base_checkpoint, ref_text, interleaved, seconds
):
    audio = reference_audio(seconds)
    voice = our_voice(ours, audio, ref_text)
    ref_codes, ref_talker, ref_predictor, ref_wav = run_reference(reference, audio, ref_text, interleaved)
    if voice.in_context:  # the reference decodes its prompt's codes in front of the generated ones
        np.testing.assert_array_equal(ref_codes[: len(voice.codes)], voice.codes)
        ref_codes = ref_codes[len(voice.codes) :]
    ours_generated = run_ours(ours, voice, interleaved)
    assert_same_generation(ours_generated, (ref_codes, ref_talker, ref_predictor), FRAMES)
    our_codes = ours_generated[0]

    streamed = stream_audio(load_codec(tiny_base_checkpoint), our_codes, voice.prime_codes)
    assert streamed.shape == ref_wav.shape == (FRAMES * 1920,)
    assert np.abs(ref_wav).max() > 0.05
    assert np.abs(streamed - ref_wav).max() <= 1e-4


def generate(ours, prompts_in_order, buckets: bool) -> dict[str, np.ndarray]:
    """Greedy codes of each (id, prompt), admitted one step apart, with or without prefill buckets."""
    config, backbone, *_ = ours
    runner = ModelRunner(backbone, max_rows=4, max_positions=256, max_text_tokens=64)
    if buckets:  # the padded prefill the GPU replays as graphs, with its extra-embedding buffer
        runner.set_buckets([], [], prefill_batch_sizes=[1, 2], prefill_lengths=[64, 128])
    engine = Engine(runner, max_running=4)
    params = GenerationParams.create(config.generation, 1000, temperature=0.0, max_frames=8, seed=0)
    codes: dict[str, list] = {}
    pending = list(prompts_in_order)
    while pending or engine.has_work:
        if pending:
            request_id, prompt = pending.pop(0)
            engine.add(Request(request_id, prompt, params))
        for output in engine.step():
            codes.setdefault(output.request.request_id, []).append(output.codes)
    return {request_id: np.stack(frames) for request_id, frames in codes.items()}


def test_cloned_prompts_prefill_through_the_padded_buckets(ours):
    """Each cloned voice's embeddings reach only its own prefill: admissions of in-context and
    x-vector prompts one after another give the codes each gets alone, unpadded."""
    _, _, prompts, *_ = ours
    in_context = our_voice(ours, reference_audio(2.0, seed=5), REFERENCE_TEXT)
    x_vector = our_voice(ours, reference_audio(1.5, seed=6), None)
    order = [  # reference frames early in the first prompt, where the second has text alone
        ("interleaved", prompts.build(TEXT, None, "english", interleaved=True, voice=in_context)),
        ("x-vector", prompts.build(TEXT, None, "english", voice=x_vector)),
        ("in-context", prompts.build(TEXT, None, "english", voice=in_context)),
    ]
    alone = {name: generate(ours, [(name, prompt)], buckets=False)[name] for name, prompt in order}
    padded = generate(ours, order, buckets=True)
    assert padded.keys() == alone.keys()
    for name, codes in alone.items():
        np.testing.assert_array_equal(padded[name], codes, err_msg=name)


@pytest.mark.parametrize("preset", ["0.6b-base", "1.7b-base"])
def test_full_size_base_presets_have_the_reference_models_tensors(preset, tmp_path):
    """Every tensor name and shape the reference's modules hold, built from the preset's config files
    (on the meta device: no weights written), is what `make-checkpoint` writes."""
    require_or_skip("qwen_tts", "the parity tests need the official qwen-tts-hf package")
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    config, speech = preset_configs(preset)
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "speech_tokenizer" / "config.json").write_text(json.dumps(speech))
    shutil.copyfile(PRESET_DIR / "common" / "generation_config.json", tmp_path / "generation_config.json")
    talker, speech_tokenizer = checkpoint_shapes(tmp_path)
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**config))
        tokenizer = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**speech))
    for ours, module in ((talker, model), (speech_tokenizer, tokenizer)):
        theirs = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
        assert {name: tuple(shape) for name, shape in ours.items()} == theirs
    assert any(name.startswith("speaker_encoder.") for name in talker)
