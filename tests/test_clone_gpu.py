"""Voice cloning on a GPU (skipped without CUDA): cloned prompts give the same codes through the
captured prefill graphs as eagerly, the speech encoder's graphs give its eager codes, and the
encoders give the CPU's voice (random tiny-base weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_clone_parity import REFERENCE_TEXT, reference_audio
from test_gpu import DEVICE, generate

from voxtriton.engine.encoder_runner import GRAPH_BATCHES, LENGTH_BUCKETS_S
from voxtriton.models.families import load_family
from voxtriton.serving.voices import VoiceEncoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_graphs_give_the_eager_codes_for_cloned_voices(tiny_base_checkpoint):
    """x-vector prompts fit the prefill graphs' buckets (their vectors go through the extra-embedding
    buffer); in-context ones are longer and prefill eagerly, beside them."""
    encoder = VoiceEncoder(load_family(tiny_base_checkpoint))
    x_vector, in_context = encoder.encode([reference_audio(1.5, seed=1)] * 2, [None, REFERENCE_TEXT])

    def prompt_for(prompts, text):
        return prompts.build(text, voice=in_context if len(text) % 2 else x_vector)

    eager = generate(tiny_base_checkpoint, graphs=False, prompt_for=prompt_for)
    graphed = generate(tiny_base_checkpoint, graphs=True, overlap=True, prompt_for=prompt_for)
    assert eager.keys() == graphed.keys() and len(eager) == 5
    for name in eager:
        np.testing.assert_array_equal(graphed[name], eager[name])


def test_the_encoders_on_the_gpu_give_the_cpus_voice(tiny_base_checkpoint):
    family = load_family(tiny_base_checkpoint)
    audio = [reference_audio(2.0, seed=3), reference_audio(1.2, seed=4)]
    on_cpu = VoiceEncoder(family).encode(audio, [None, None])
    on_gpu = VoiceEncoder(family, DEVICE).encode(audio, [None, None])
    for cpu, gpu in zip(on_cpu, on_gpu):
        scale = np.abs(cpu.embedding).max()
        assert np.abs(gpu.embedding - cpu.embedding).max() <= 1e-3 * scale
        assert gpu.codes.shape == cpu.codes.shape
        np.testing.assert_array_equal(gpu.codes[:, 0], cpu.codes[:, 0])  # the semantic codebook


def test_the_encoder_graphs_give_the_eager_voices(tiny_base_checkpoint):
    """Every (batch, length) bucket of both encoders captured; recordings of different lengths,
    alone and in batches of two and three (a graph's two rows, then one), get the voices of an eager
    run at the same bucket shapes, and the semantic codebook and x-vector of an eager run at each
    recording's own length."""
    family = load_family(tiny_base_checkpoint)
    graphed = VoiceEncoder(family, DEVICE, graphs=True)
    eager = VoiceEncoder(family, DEVICE)
    assert graphed.graph_count() == 2 * len(LENGTH_BUCKETS_S) * len(GRAPH_BATCHES)
    assert eager.graph_count() == 0
    eager_calls = []  # the graphed encoder's, after capture: none
    for runner in (graphed.speech_encoder, graphed.speaker_encoder):
        model = runner.model
        runner.model = lambda audio, lengths, model=model: (
            eager_calls.append(audio.shape) or model(audio, lengths)
        )
    waves = [reference_audio(seconds, seed=seed) for seed, seconds in enumerate([1.0, 2.3, 9.7])]
    for batch in (waves[:1], waves, waves[1:]):
        texts = [REFERENCE_TEXT] * len(batch)
        for replayed, run in zip(graphed.encode(batch, texts), eager.encode(batch, texts)):
            np.testing.assert_array_equal(replayed.codes, run.codes)
            scale = np.abs(run.embedding).max()
            np.testing.assert_allclose(replayed.embedding, run.embedding, rtol=0, atol=1e-6 * scale)
    assert eager_calls == []
    for wave, voice in zip(waves, graphed.encode(waves, [REFERENCE_TEXT] * 3)):
        with torch.inference_mode():  # each encoder eagerly at the recording's own length
            audio = torch.from_numpy(wave)[None].to(DEVICE)
            x_vector = eager.speaker_encoder.model(audio)[0].float().cpu().numpy()
            codes = eager.speech_encoder.model(audio)[0].cpu().numpy()
        np.testing.assert_array_equal(voice.codes[:, 0], codes[:, 0])
        assert np.abs(voice.embedding - x_vector).max() <= 1e-3 * np.abs(x_vector).max()  # TF32 convolutions
