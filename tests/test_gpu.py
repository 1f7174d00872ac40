"""GPU paths (skipped on machines without CUDA): CUDA graphs against eager, codec graphs, SM partitions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from voxtriton.engine.codec_runner import CodecRunner
from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.kernels import check_kernels
from voxtriton.kernels.attention import decode_attention_supported
from voxtriton.models.config import load_config
from voxtriton.models.layers import StaticKV, causal_mask
from voxtriton.models.loader import load_backbone, load_codec
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.serving.runtime import SMPartition
from voxtriton.serving.state_pool import CodecStatePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = torch.device("cuda:0")
TEXTS = ["One.", "Two voices now.", "Three streams share a batch.", "Four is padded to eight.", "Five!"]
# Longer than the largest prefill bucket of `generate` (32 positions): its prefill runs eagerly.
LONG_TEXT = (
    "A prompt of many more words than the prefill graphs were captured for, so that its prefill runs "
    "outside them, eagerly, at the length it has."
)


def generate(
    checkpoint,
    graphs: bool,
    dtype=torch.bfloat16,
    overlap: bool = False,
    texts=TEXTS,
    when_ready=lambda: None,
    prompt_for=lambda prompts, text: prompts.build(text, "ryan"),
    first_frame_rows: int = 0,
    early: list[str] | None = None,
    defer_advance: bool = False,
    deferred_steps: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """A request per text through the engine, the first three admitted at step 0 (rows 0-2), the
    rest at step 2; `when_ready` is called once the graphs are captured, before the first admission.
    `prompt_for(prompt builder, text)` makes each request's prompt; `first_frame_rows` the engine's
    (and the graphs' split steps); `early`, if given, gets the ids of requests whose first frame
    came early; `defer_advance` is passed to every step, and `deferred_steps`, if given, gets the
    steps that left their second part to the next."""
    config = load_config(checkpoint)
    backbone = load_backbone(checkpoint, config, device=DEVICE, dtype=dtype)
    prompts = PromptBuilder(config, TextTokenizer(checkpoint))
    runner = ModelRunner(
        backbone,
        max_rows=8,
        max_positions=512,
        max_text_tokens=64,
        prefill_stream=torch.cuda.Stream(DEVICE) if overlap else None,
    )
    buckets = dict(
        batch_sizes=[1, 2, 4, 8], spans=[128, 512], prefill_batch_sizes=[1, 2], prefill_lengths=[16, 32]
    )
    if graphs:
        runner.capture_graphs(**buckets, first_frame_rows=first_frame_rows)
        # (1 or 2 requests) x (16 or 32 positions).
        assert len(runner.prefill_graphs) == 4 and len(runner.admission_graphs) == 4
        # Batch buckets 1, 2, 4 of at most 4 rows: the first part per bucket, the second per span too.
        split = (3, 6) if first_frame_rows else (0, 0)
        assert (len(runner.first_part_graphs), len(runner.second_part_graphs)) == split
    else:
        runner.set_buckets(**buckets)
    engine = Engine(runner, max_running=8, overlap=overlap, first_frame_rows=first_frame_rows)
    if early is not None:
        first_frames = engine._first_frames

        def recorded(launched):
            outputs = first_frames(launched)
            early.extend(output.request.request_id for output in outputs)
            return outputs

        engine._first_frames = recorded
    when_ready()
    requests = [
        Request(
            f"r{i}",
            prompt_for(prompts, text),
            GenerationParams.create(config.generation, 400, seed=i, max_frames=30 + 10 * i, ignore_eos=True),
        )
        for i, text in enumerate(texts)
    ]
    codes: dict[str, list] = {}
    step = 0
    while step < 2 or engine.has_work:
        if step == 0:
            for request in requests[:3]:
                engine.add(request)
        if step == 2:
            for request in requests[3:]:
                engine.add(request)
        for output in engine.step(defer_advance=defer_advance):
            codes.setdefault(output.request.request_id, []).append(output.codes)
        if deferred_steps is not None and engine.deferred is not None:
            deferred_steps.append(step)
        step += 1
    return {k: np.stack(v) for k, v in codes.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graphs_give_the_eager_codes(tiny_checkpoint, overlap):
    """Also with the next frame step launched before the host reads a step's frames, prompts
    uploaded and frames read through the transfer stream, and prefills run on a stream of their own
    while a step is in flight."""
    eager = generate(tiny_checkpoint, graphs=False)
    graphed = generate(tiny_checkpoint, graphs=True, overlap=overlap)
    assert eager.keys() == graphed.keys() and len(eager) == 5
    for name in eager:
        np.testing.assert_array_equal(graphed[name], eager[name])


@pytest.mark.parametrize("defer_advance", [False, True])
def test_first_frames_read_between_the_steps_two_graphs_give_the_eager_codes(tiny_checkpoint, defer_advance):
    """The frame step captured in two parts (batches up to 4 rows: the first three requests' first
    frames come early, the last two's, at 5 rows, do not), with overlap (first frames come early
    only then), against eager steps without the split; also with the second part launched by the
    next step (`defer_advance`)."""
    eager = generate(tiny_checkpoint, graphs=False)
    early: list[str] = []
    deferred_steps: list[int] = []
    graphed = generate(
        tiny_checkpoint,
        graphs=True,
        overlap=True,
        first_frame_rows=4,
        early=early,
        defer_advance=defer_advance,
        deferred_steps=deferred_steps,
    )
    assert early == ["r0", "r1", "r2"]
    assert deferred_steps == ([0] if defer_advance else [])  # step 0: the first three's first frames alone
    assert eager.keys() == graphed.keys() and len(eager) == 5
    for name in eager:
        np.testing.assert_array_equal(graphed[name], eager[name])


def test_admissions_after_capture_compile_no_triton_kernel(tiny_checkpoint):
    """What runs outside the graphs while serving (prefills of prompts longer than the graphs' buckets,
    each admission's first-code sampling, for rows anywhere in the batch) selects kernel variants
    the capture compiled: Triton compiles on the launching thread, and a compile while serving holds
    every stream for a second or more. In a process of its own, whose kernels are not compiled yet
    (Triton's disk cache may hold them; loading one counts too)."""
    script = f"""
import json, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from triton import knobs
import test_gpu
from voxtriton.kernels import check_kernels

compiled = {{"before": [], "after": []}}
phase = "before"

def count(*, repr, **_):
    compiled[phase].append(repr)

def ready():
    global phase
    phase = "after"

knobs.runtime.jit_post_compile_hook = count
test_gpu.generate(
    {str(tiny_checkpoint)!r}, graphs=True, texts=test_gpu.TEXTS + [test_gpu.LONG_TEXT], when_ready=ready
)
print(json.dumps({{"usable": check_kernels(test_gpu.DEVICE), **compiled}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(result["usable"].values()), result["usable"]  # else a formula ran and nothing compiled
    assert result["before"] and result["after"] == [], result["after"]


def test_codec_graphs_match_eager(tiny_checkpoint, monkeypatch):
    # Full fp32 convolutions: with TF32 (PyTorch's cuDNN default) the padded graph batch and the
    # eager one may get algorithms that round differently.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    codec = load_codec(tiny_checkpoint, device=DEVICE, dtype=torch.float32)
    runner = CodecRunner(codec, batch_buckets=[1, 2, 4], frame_sizes=[4, 25])
    codes = torch.randint(0, 2048, (3, 29, 16), device=DEVICE)
    start = torch.zeros(3, dtype=torch.long, device=DEVICE)
    state_a = state_b = codec.new_state(3)
    offset = 0
    for size in (4, 25):  # graphed shapes: batch 3 padded to 4
        chunk = codes[:, offset : offset + size]
        audio_a, state_a = runner.decode(chunk, start + offset, state_a)
        audio_b, state_b = codec.decode(chunk, start + offset, state_b)
        assert (audio_a - audio_b).abs().max().item() <= 1e-5
        offset += size
    assert len(runner.graphs) == 6


def test_an_uncaptured_length_runs_as_captured_pieces_and_gives_the_eager_audio(tiny_checkpoint, monkeypatch):
    """A chunk of a length that was not captured runs through the graphs of captured lengths."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    codec = load_codec(tiny_checkpoint, device=DEVICE, dtype=torch.float32)
    runner = CodecRunner(codec, batch_buckets=[1, 2], frame_sizes=[4, 25])
    assert sorted(runner.graphs) == [(1, 4), (1, 25), (2, 4), (2, 25)]
    assert runner._captured_pieces(1, 83) == (25, 25, 25, 4, 4)
    assert runner._captured_pieces(2, 58) == (25, 25, 4, 4)
    eager = codec.decode
    calls = []  # eager calls, after capture
    monkeypatch.setattr(codec, "decode", lambda *args: calls.append(args[0].shape[1]) or eager(*args))
    for batch, frames in ((1, 83), (2, 58)):
        codes = torch.randint(0, 2048, (batch, frames, 16), device=DEVICE)
        start = torch.zeros(batch, dtype=torch.long, device=DEVICE)
        audio_a, state_a = runner.decode(codes, start, codec.new_state(batch))
        audio_b, state_b = eager(codes, start, codec.new_state(batch))
        assert calls == []
        assert (audio_a - audio_b).abs().max().item() <= 1e-5
        assert (state_a.float() - state_b.float()).abs().max().item() <= 1e-4
    start = torch.zeros(1, dtype=torch.long, device=DEVICE)
    odd = codes[:1, :3]  # 3 frames: no captured lengths add up to it, so it runs eagerly
    audio_a, _ = runner.decode(odd, start, codec.new_state(1))
    assert calls == [3] and (audio_a - eager(odd, start, codec.new_state(1))[0]).abs().max().item() <= 1e-5


def test_a_gpu_priming_runs_as_graphs_and_leaves_the_state_a_decode_does(tiny_checkpoint, monkeypatch):
    """An in-context voice's reference codes (a recording's length, 125 frames for 10 s) prime its
    state through the priming graphs: the first half as captured lengths, the second half once. A
    batch runs eagerly, with cuDNN's autotuning off for the call and back on after it."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    codec = load_codec(tiny_checkpoint, device=DEVICE, dtype=torch.float32)
    runner = CodecRunner(codec, batch_buckets=[1], frame_sizes=[4, 25], priming_sizes=[1, 4, 25, 100])
    assert sorted(runner.front_graphs) == [1, 4, 25, 100] and runner.back_graph is not None
    eager = []
    prime = codec.prime
    monkeypatch.setattr(
        codec, "prime", lambda *args: eager.append(torch.backends.cudnn.benchmark) or prime(*args)
    )
    for batch, frames in ((1, 125), (1, 38), (2, 30)):
        codes = torch.randint(0, 2048, (batch, frames, 16), device=DEVICE)
        start = torch.zeros(batch, dtype=torch.long, device=DEVICE)
        state = runner.prime(codes, start, codec.new_state(batch))
        _, decoded = codec.decode(codes, start, codec.new_state(batch))
        assert (state.float() - decoded.float()).abs().max().item() <= 1e-4, (batch, frames)
    assert eager == [False] and torch.backends.cudnn.benchmark  # the batch of 2 only


def test_a_priming_call_answers_once_its_state_is_written(tiny_base_checkpoint, monkeypatch):
    """A priming sends no audio back, whose copy would wait for the codec's stream: the call waits
    for the state's write-back itself, so the row read right after it holds the primed state (a
    registered voice's is kept from there)."""
    from voxtriton.serving.codec_service import CodecService
    from voxtriton.serving.settings import CodecSettings

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    # The service sets cuDNN's autotuning for the process: restored after the test.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    service = CodecService(
        CodecSettings(
            checkpoint_dir=str(tiny_base_checkpoint),
            device="cuda:0",
            dtype="float32",
            graph_batch_sizes="1",
            graph_frame_sizes="2",
        )
    )
    assert sorted(service.runner.front_graphs) == [1, 4, 25, 100]
    prime = service.runner.prime

    def slow_prime(*args):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the priming, on its stream
        return prime(*args)

    monkeypatch.setattr(service.runner, "prime", slow_prime)
    pool = torch.zeros(3, service.state_size, device=DEVICE)
    codes = torch.randint(0, 2048, (1, 30, 16), dtype=torch.int32)
    start, slots = torch.zeros(1, dtype=torch.int64), torch.tensor([1])
    audio = service.decode(codes, start, slots, pool, prime=True)
    primed = pool[1].cpu()  # on the default stream: it does not wait for the codec's
    assert audio.shape == (1, 0)
    _, decoded = service.model.decode(codes.to(DEVICE), start.to(DEVICE), service.model.new_state(1))
    assert (primed - decoded[0].cpu()).abs().max().item() <= 1e-4


@pytest.mark.parametrize("value", ["false", "true"])
def test_a_graphed_codec_autotunes_cudnn_as_its_setting_says(tiny_checkpoint, value):
    from voxtriton.serving.codec_service import CodecService
    from voxtriton.serving.settings import CodecSettings

    previous = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = value != "true"
        CodecService(
            CodecSettings(
                checkpoint_dir=str(tiny_checkpoint),
                device="cuda:0",
                graph_batch_sizes="1",
                graph_frame_sizes="2",
                cudnn_autotune=value == "true",
            )
        )
        assert torch.backends.cudnn.benchmark is (value == "true")
    finally:
        torch.backends.cudnn.benchmark = previous


def test_codec_with_triton_kernels_matches_the_cpu_reference(tiny_checkpoint):
    """The whole decoder, chunked with carried state: CUDA (fused Triton kernels, cuDNN) against the
    CPU's reference formulas, both fp32. cuDNN convolutions may use TF32, hence the tolerance."""
    usable = check_kernels(DEVICE)
    assert all(usable.values()), f"every Triton kernel must run here, not its fallback formula: {usable}"
    gpu = load_codec(tiny_checkpoint, device=DEVICE, dtype=torch.float32)
    cpu = load_codec(tiny_checkpoint, dtype=torch.float32)
    codes = torch.randint(0, 2048, (3, 31, 16), generator=torch.Generator().manual_seed(3))
    state_gpu, state_cpu, offset = gpu.new_state(3), cpu.new_state(3), 0
    for size in (2, 4, 25):
        chunk, start = codes[:, offset : offset + size], torch.full((3,), offset)
        audio_gpu, state_gpu = gpu.decode(chunk.to(DEVICE), start.to(DEVICE), state_gpu)
        audio_cpu, state_cpu = cpu.decode(chunk, start, state_cpu)
        error = (audio_gpu.cpu() - audio_cpu).norm() / audio_cpu.norm()
        assert error < 1e-2, f"chunk of {size} frames: relative error {error:.2e}"
        offset += size


def test_decode_attention_kernel_matches_sdpa_in_the_talker(tiny_checkpoint):
    """The talker's decode step through the Triton kernel (mask None) and through SDPA (an explicit
    causal mask) over the same cache, whose entries past each row's position are garbage to ignore."""
    config = load_config(tiny_checkpoint)
    model = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=torch.float32).talker.model
    t = config.talker.transformer
    assert decode_attention_supported(DEVICE, model.group, model.head_dim)
    batch, span = 3, 96
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(t.num_layers, batch, t.num_kv_heads, span, t.head_dim, generator=generator).to(DEVICE)
    values = torch.randn(keys.shape, generator=generator).to(DEVICE)
    positions = torch.tensor([[5], [64], [95]], device=DEVICE)
    x = torch.randn(batch, 1, t.hidden_size, generator=generator).to(DEVICE)
    outputs = []
    with torch.inference_mode():
        for mask in (None, causal_mask(positions, span)):
            cache = StaticKV(keys.clone(), values.clone())
            outputs.append(model(x, positions, cache.bind(positions, span), mask))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)


def test_green_context_partition_runs_work_on_its_stream():
    partition = SMPartition(DEVICE, 16)
    assert partition.stream is not None
    with partition:
        x = torch.randn(2048, 2048, device=DEVICE)
        y = (x @ x).sum()
    partition.stream.synchronize()
    assert torch.isfinite(y)


def test_graphs_capture_and_replay_on_a_partition(tiny_checkpoint):
    """The serving path: the backbone's graphs are captured and replayed on a green-context stream."""
    config = load_config(tiny_checkpoint)
    backbone = load_backbone(tiny_checkpoint, config, device=DEVICE, dtype=torch.bfloat16)
    prompts = PromptBuilder(config, TextTokenizer(tiny_checkpoint))
    total = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    results = []
    for graphs in (False, True):  # graphs as the server runs them: overlapped, prefills on a partition stream
        partition = SMPartition(DEVICE, total - 16)
        runner = ModelRunner(
            backbone,
            max_rows=4,
            max_positions=256,
            max_text_tokens=64,
            prefill_stream=partition.new_stream() if graphs else None,
        )
        with partition:
            if graphs:
                runner.capture_graphs([1, 2, 4], [128], prefill_batch_sizes=[1], prefill_lengths=[32, 64])
            else:
                runner.set_buckets([1, 2, 4], [128])
            engine = Engine(runner, max_running=4, overlap=graphs)
            engine.add(
                Request(
                    "p",
                    prompts.build("Partitioned.", "ryan"),
                    GenerationParams.create(config.generation, 100, seed=3, max_frames=20, ignore_eos=True),
                )
            )
            codes = []
            while engine.has_work:
                codes += [o.codes for o in engine.step()]
            timing = engine.last_timing  # the last step's decode, timed on the GPU and on the host
            assert 0 < timing.decode_device_s < 1 and timing.decode_s < 1
            if not graphs:  # in-step: the host waited through the whole decode
                assert timing.decode_device_s <= timing.decode_s + 1e-3
        results.append(np.stack(codes))
    np.testing.assert_array_equal(results[0], results[1])


def test_codec_state_pool_is_shared_with_another_process_through_cuda_ipc():
    pool = CodecStatePool(rows=4, state_size=1000, device=DEVICE, publish_for=os.getpid())
    script = (
        "import os, sys, torch; from voxtriton.serving.state_pool import attach; "
        "attach(sys.stdin.buffer.read(), os.getppid())[2] += 7; torch.cuda.synchronize()"
    )
    subprocess.run([sys.executable, "-c", script], input=pool.handle, check=True, timeout=120)
    assert pool.tensor[2].eq(7).all() and pool.tensor[[0, 1, 3]].eq(0).all()
    pool.close()
