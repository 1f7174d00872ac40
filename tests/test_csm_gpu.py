"""CSM on the GPU (skipped on machines without CUDA): its frame step and padded prefills captured as
CUDA graphs give the eager codes, also with prefills beside the step in flight and with a context
turn's frames in a padded prefill, and the Mimi codec's graphs give the eager audio (random-weight
`csm-tiny` checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxtriton.engine.codec_runner import CodecRunner
from voxtriton.engine.engine import Engine
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.csm.checkpoint import make_csm_checkpoint
from voxtriton.models.csm.loader import load_mimi_encoder
from voxtriton.models.families import load_family
from voxtriton.models.voice import Voice

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda:0")
TEXTS = ["One.", "Two voices now.", "Three streams share a batch.", "Four is padded to eight.", "Five!"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0)


@pytest.fixture(scope="module")
def family(checkpoint):
    return load_family(checkpoint)


def generate(family, graphs: bool, dtype=torch.bfloat16, overlap: bool = False) -> dict[str, np.ndarray]:
    """A request per text through the engine, the first three admitted at step 0, the rest at step 2
    (so rows move and batches pad to their buckets); sampled with per-request seeds. Prompts go in
    groups of 2 padded to 16 or 32 positions, the third (33 positions) eagerly at its own shape;
    `overlap`: prefills on a stream of their own, beside the step in flight."""
    backbone = family.load_backbone(device=DEVICE, dtype=dtype)
    runner = family.new_runner(
        backbone, 8, 512, 64, prefill_stream=torch.cuda.Stream(DEVICE) if overlap else None
    )
    buckets = dict(
        batch_sizes=[1, 2, 4, 8], spans=[128, 512], prefill_batch_sizes=[1, 2], prefill_lengths=[16, 32]
    )
    if graphs:
        runner.capture_graphs(**buckets)
        assert len(runner.graphs) == 8 and len(runner.move_graphs) == 2
        # (1 or 2 requests) x (16 or 32 positions).
        assert len(runner.prefill_graphs) == 4 and len(runner.admission_graphs) == 4
    else:
        runner.set_buckets(**buckets)
    engine = Engine(runner, max_running=8, overlap=overlap)
    requests = [
        Request(
            f"r{i}",
            family.prompt.prompt(text, i % 2),
            GenerationParams.create(family.sampling, 400, seed=i, max_frames=20 + 5 * i, ignore_eos=True),
        )
        for i, text in enumerate(TEXTS)
    ]
    codes: dict[str, list] = {}
    step = 0
    while step < 2 or engine.has_work:
        for request in requests[:3] if step == 0 else requests[3:] if step == 2 else []:
            engine.add(request)
        for output in engine.step():
            codes.setdefault(output.request.request_id, []).append(output.codes)
        step += 1
    return {name: np.stack(frames) for name, frames in codes.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graphs_give_the_eager_codes(family, overlap):
    assert [len(family.prompt.build(text, 0)) for text in TEXTS[:3]] == [9, 20, 33]
    eager = generate(family, graphs=False)
    graphed = generate(family, graphs=True, overlap=overlap)
    assert eager.keys() == graphed.keys() and len(eager) == 5
    for name in eager:
        assert graphed[name].shape == (20 + 5 * int(name[1:]), 32)
        np.testing.assert_array_equal(graphed[name], eager[name])


def test_greedy_codes_on_the_gpu_equal_the_model_in_fp32(family):
    """fp32 on the GPU: the engine's greedy frames (graphs) are the model's own greedy frames."""
    model = family.load_backbone(device=DEVICE, dtype=torch.float32)
    runner = family.new_runner(model, 2, 256, 64)
    runner.capture_graphs(batch_sizes=[1, 2], spans=[256], prefill_batch_sizes=[1], prefill_lengths=[64])
    assert len(runner.prefill_graphs) == 1  # the prompt is padded to 64 positions
    engine = Engine(runner, max_running=2)
    ids = family.prompt.build(TEXTS[2], 1)
    engine.add(
        Request(
            "g",
            family.prompt.prompt(TEXTS[2], 1),
            GenerationParams.create(family.sampling, 100, temperature=0.0, max_frames=8),
        )
    )
    frames = []
    while engine.has_work:
        frames += [output.codes for output in engine.step()]
    with torch.inference_mode():
        expected = model.generate(
            torch.tensor([ids], device=DEVICE), 8, lambda logits, codebook: logits.argmax(-1)
        )
    np.testing.assert_array_equal(np.stack(frames), expected[0].cpu().numpy())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_context_turn_in_a_graphed_prefill_gives_the_eager_codes(family, overlap):
    """A context prompt (its frames from the GPU Mimi encoder) padded into a prefill graph beside a plain
    prompt: the graphs give the eager codes, and the extra-embedding buffer is zero afterwards."""
    audio = torch.randn(1, 24000, generator=torch.Generator().manual_seed(4)) * 0.3
    encoder = load_mimi_encoder(family.checkpoint, family.config, device=DEVICE)
    with torch.inference_mode():
        codes = encoder(audio.to(DEVICE))[0].cpu().numpy().astype(np.int64)
    voice = Voice(np.zeros(0, np.float32), codes, "The context turn.")

    def run(graphs: bool) -> dict[str, np.ndarray]:
        runner = family.new_runner(
            family.load_backbone(device=DEVICE, dtype=torch.float32),
            4,
            256,
            64,
            prefill_stream=torch.cuda.Stream(DEVICE) if overlap else None,
        )
        buckets = dict(batch_sizes=[1, 2, 4], spans=[256], prefill_batch_sizes=[2], prefill_lengths=[64])
        if graphs:
            runner.capture_graphs(**buckets)
        else:
            runner.set_buckets(**buckets)
        engine = Engine(runner, max_running=4, overlap=overlap)
        for name, prompt in (
            ("plain", family.prompt.prompt(TEXTS[1], 1)),
            ("context", family.prompt.prompt(TEXTS[1], 1, voice)),
        ):
            params = GenerationParams.create(family.sampling, 100, temperature=0.0, max_frames=10)
            engine.add(Request(name, prompt, params))
        out: dict[str, list] = {}
        while engine.has_work:
            for output in engine.step():
                out.setdefault(output.request.request_id, []).append(output.codes)
        assert not runner.prefill_extra.any()
        return {name: np.stack(frames) for name, frames in out.items()}

    assert len(family.prompt.prompt(TEXTS[1], 1, voice).text_ids) <= 64
    eager, graphed = run(False), run(True)
    for name in ("plain", "context"):
        np.testing.assert_array_equal(graphed[name], eager[name])
    assert not np.array_equal(eager["plain"], eager["context"])


def test_mimi_graphs_give_the_eager_audio_chunk_by_chunk(family, monkeypatch):
    # Full fp32 convolutions: with TF32 the padded graph batch and the eager one may get algorithms that
    # round differently.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    mimi = family.load_codec(device=DEVICE, dtype=torch.float32)
    runner = CodecRunner(mimi, batch_buckets=[1, 4], frame_sizes=[2, 8])
    codes = torch.randint(0, family.codec_vocab, (3, 22, 32), device=DEVICE)
    graphed, eager = mimi.new_state(3), mimi.new_state(3)
    start = 0
    for size in (2, 8, 2, 8, 2):  # graphed shapes, batch 3 padded to 4, past the attention window
        chunk, first = codes[:, start : start + size], torch.full((3,), start, device=DEVICE)
        audio_graph, graphed = runner.decode(chunk, first, graphed)
        audio_eager, eager = mimi.decode(chunk, first, eager)
        assert audio_graph.shape == (3, size * 1920)
        assert (audio_graph - audio_eager).abs().max().item() <= 1e-5
        start += size
    assert len(runner.graphs) == 4


def test_the_csm_codec_lane_starts_with_graphs_and_no_priming_graphs(checkpoint, monkeypatch):
    """A CSM voice is a context turn, not a primed codec state: Mimi has nothing to prime, and its
    lanes start with the default settings (priming sizes included) on a GPU."""
    from voxtriton.serving.codec_service import CodecService
    from voxtriton.serving.settings import CodecSettings

    # The service sets cuDNN's autotuning for the process: restored after the test.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    service = CodecService(
        CodecSettings(
            checkpoint_dir=str(checkpoint), device="cuda:0", graph_batch_sizes="1", graph_frame_sizes="2"
        )
    )
    assert service.runner.graphs and not service.runner.front_graphs and service.runner.back_graph is None
