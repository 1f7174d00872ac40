"""Voice cloning on a GPU (skipped without CUDA): cloned prompts give the same codes through the
captured prefill graphs as eagerly, and the encoders give the CPU's voice (random tiny-base weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_clone_parity import REFERENCE_TEXT, reference_audio
from test_gpu import DEVICE, generate

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
