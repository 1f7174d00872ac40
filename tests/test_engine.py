"""Continuous batching on CPU: requests join and leave a running batch without changing each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxtriton.bench.call_counter import GRAPHED, CallCounter
from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.config import load_config
from voxtriton.models.layers import Rotary
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer

TEXTS = [
    "The first request speaks.",
    "A second, longer request arrives a little later on.",
    "Third!",
    "Number four has something to say as well.",
    "Five.",
]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    config = load_config(tiny_checkpoint)
    return (
        config,
        load_backbone(tiny_checkpoint, config),
        PromptBuilder(config, TextTokenizer(tiny_checkpoint)),
    )


def make_request(setup, index, frames=20, **sampling):
    config, _, prompts = setup
    params = GenerationParams.create(
        config.generation, 1000, seed=100 + index, max_frames=frames, ignore_eos=True, **sampling
    )
    return Request(f"r{index}", prompts.build(TEXTS[index], "vivian"), params)


@pytest.fixture(params=[False, True], ids=["in-step", "overlap"])
def overlap(request):
    """Every engine test runs both ways: frames returned by the step that launched them, and (the
    server's default) by the next one."""
    return request.param


def new_engine(setup, rows=8, overlap=False, first_frame_rows=0):
    return Engine(
        ModelRunner(setup[1], max_rows=rows, max_positions=512, max_text_tokens=64),
        max_running=rows,
        overlap=overlap,
        first_frame_rows=first_frame_rows,
    )


def run(engine, arrivals: dict[int, list[Request]], cancel_at: dict[int, Request] | None = None):
    """Step until idle; `arrivals[step]` join before that step. Returns codes per request id."""
    codes: dict[str, list] = {}
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for request in arrivals.get(step, []):
            engine.add(request)
        if cancel_at and step in cancel_at:
            cancel_at[step].cancelled = True
        for output in engine.step():
            codes.setdefault(output.request.request_id, []).append(output.codes)
        step += 1
    return {k: np.stack(v) for k, v in codes.items()}


def test_requests_joining_a_running_batch_get_the_codes_they_get_alone(setup, overlap):
    alone = {}
    for i in range(4):
        alone.update(run(new_engine(setup), {0: [make_request(setup, i, frames=12 + 3 * i)]}))
    together = run(
        new_engine(setup, overlap=overlap),
        {
            0: [make_request(setup, 0, 12)],
            2: [make_request(setup, 1, 15)],
            3: [make_request(setup, 2, 18), make_request(setup, 3, 21)],
        },
    )
    for request_id, codes in alone.items():
        assert codes.shape == (len(codes), 16)
        np.testing.assert_array_equal(together[request_id], codes)


def test_finishing_requests_free_their_rows_and_others_continue(setup, overlap):
    engine = new_engine(setup, rows=2, overlap=overlap)
    short, long_, waiting = make_request(setup, 0, 3), make_request(setup, 1, 10), make_request(setup, 2, 4)
    result = run(engine, {0: [short, long_, waiting]})
    assert {k: len(v) for k, v in result.items()} == {"r0": 3, "r1": 10, "r2": 4}
    assert engine.running == [] and not engine.waiting and not engine.has_work
    # No frame was launched past max_frames: rows leave at the launch of their last frame.
    assert all(r.frames == r.emitted == r.params.max_frames for r in (short, long_, waiting))
    assert all(r.finish_reason == "max_frames" for r in (short, long_, waiting))
    np.testing.assert_array_equal(
        result["r1"], run(new_engine(setup), {0: [make_request(setup, 1, 10)]})["r1"]
    )


def test_cancelled_request_leaves_at_the_next_step(setup, overlap):
    engine = new_engine(setup, overlap=overlap)
    victim, survivor = make_request(setup, 0, 50), make_request(setup, 1, 8)
    result = run(engine, {0: [victim, survivor]}, cancel_at={3: victim})
    # Cancelled before the fourth launch; with overlap the third frame was still on its way, and dropped.
    assert victim.finish_reason == "cancelled" and len(result["r0"]) == 3 - overlap
    np.testing.assert_array_equal(
        result["r1"], run(new_engine(setup), {0: [make_request(setup, 1, 8)]})["r1"]
    )


def test_a_request_whose_cache_ends_at_its_last_frame_never_writes_past_it(setup, overlap):
    """max_positions = prompt + max_frames: a frame launched after the last one would write past the
    cache (an out-of-bounds write on a GPU)."""
    request = make_request(setup, 0, frames=6)
    runner = ModelRunner(setup[1], max_rows=2, max_positions=request.position + 6, max_text_tokens=64)
    result = run(Engine(runner, max_running=2, overlap=overlap), {0: [request]})
    assert len(result["r0"]) == 6 and request.frames == 6


def test_a_cancellation_with_the_last_frame_in_flight_drops_it(setup, overlap):
    """Cancelled after its last frame was launched: with overlap that frame is still on its way and is
    dropped; in-step it was already returned, and the request finished normally."""
    request = make_request(setup, 0, frames=3)
    result = run(new_engine(setup, overlap=overlap), {0: [request]}, cancel_at={3: request})
    expected = ("cancelled", 2) if overlap else ("max_frames", 3)
    assert (request.finish_reason, len(result["r0"])) == expected


def test_rows_all_paused_for_text_leave_a_queued_request_nothing_to_do(setup):
    """Every row holds an input stream waiting for its text and a request waits for a row: no step
    can do anything (the engine thread waits), until text comes or a row frees."""
    config, _, prompts = setup
    engine = new_engine(setup, rows=1)
    params = GenerationParams.create(config.generation, 1000, seed=1, max_frames=40, ignore_eos=True)
    stream = Request(
        "s", prompts.head("vivian").prompt([1000], True, text_ended=False), params, text_open=True
    )
    engine.add(stream)
    engine.add_text(stream, [1000, 1000], end=False)
    for _ in range(5):
        engine.step()
    engine.step()
    assert engine.waiting_for_text() == [stream] and not engine.has_work
    queued = make_request(setup, 0)
    engine.add(queued)
    assert not engine.has_work  # no row for it
    queued.cancelled = True
    assert engine.has_work  # a cancelled request is swept from the queue
    engine.step()
    assert not engine.waiting and not engine.has_work
    engine.add(make_request(setup, 1))
    engine.add_text(stream, [1000] * 4, end=True)
    assert engine.has_work


def test_seed_controls_sampling(setup):
    first = run(new_engine(setup), {0: [make_request(setup, 0, 6)]})["r0"]
    again = run(new_engine(setup), {0: [make_request(setup, 0, 6)]})["r0"]
    np.testing.assert_array_equal(first, again)
    other = make_request(setup, 0, 6)
    other.params = GenerationParams.create(setup[0].generation, 1000, seed=999, max_frames=6, ignore_eos=True)
    assert not np.array_equal(first, run(new_engine(setup), {0: [other]})["r0"])


def test_eos_ends_a_request_after_the_official_two_frame_minimum(setup, tiny_checkpoint, overlap):
    """A talker that always prefers end-of-speech still yields two frames (min_new_tokens=2). With
    overlap the end is seen one step late: the frame launched meanwhile is dropped, and the request
    waiting for the freed row gets the codes it gets alone."""
    config, _, prompts = setup
    backbone = load_backbone(tiny_checkpoint, config)

    def prefer_eos(module, args, logits):
        return logits.index_fill(-1, torch.tensor([config.talker.codec_eos_id]), 100.0)

    backbone.talker.codec_head.register_forward_hook(prefer_eos)

    def new():
        return Engine(
            ModelRunner(backbone, max_rows=2, max_positions=256, max_text_tokens=64),
            max_running=2,
            overlap=overlap,
        )

    def request(name, text, **length):
        return Request(
            name,
            prompts.build(text, "ryan"),
            GenerationParams.create(config.generation, 1000, temperature=0.0, **length),
        )

    eager = request("eager", "Stop soon.", max_frames=30)
    stubborn = request("stubborn", "Keep going.", max_frames=9, ignore_eos=True)
    late = request("late", "Wait for a row.", max_frames=4, ignore_eos=True)
    result = run(new(), {0: [eager, stubborn, late]})
    assert (eager.finish_reason, len(result["eager"])) == ("eos", 2)
    assert (stubborn.finish_reason, len(result["stubborn"])) == ("max_frames", 9)
    assert config.talker.codec_eos_id not in result["stubborn"][:, 0]
    # stubborn moved into eager's row when eager left (a step late, with overlap) and late took the
    # last row: both get the codes they get alone.
    for name, text, frames in (("stubborn", "Keep going.", 9), ("late", "Wait for a row.", 4)):
        alone = run(new(), {0: [request(name, text, max_frames=frames, ignore_eos=True)]})
        np.testing.assert_array_equal(result[name], alone[name])


def run_timed(engine, arrivals: dict[int, list[Request]], first_frames_early: bool = True, **step_options):
    """`run`, also returning the step that returned each request's first frame."""
    codes, first_step, step = {}, {}, 0
    while engine.has_work or any(s >= step for s in arrivals):
        for request in arrivals.get(step, []):
            engine.add(request)
        for output in engine.step(first_frames_early, **step_options):
            first_step.setdefault(output.request.request_id, step)
            codes.setdefault(output.request.request_id, []).append(output.codes)
        step += 1
    return {k: np.stack(v) for k, v in codes.items()}, first_step


def test_first_frames_come_as_soon_as_their_step_completes_them_with_the_same_codes(setup):
    """With overlap and `first_frame_rows`, a request's first frame comes back from the step that
    launched it (read before the talker advances), one step sooner; every code, length and end is
    what the engine gives without it. Above `first_frame_rows` rows, first frames wait as usual;
    without overlap (a step's frames come back with it anyway) the setting is off, and so it is for a
    step whose caller says the load is not light."""

    def arrivals(one_frame_first=False):
        # r1's first frame is its last: it leaves at launch, and where it holds row 0, r0 moves into it
        pair = [make_request(setup, 0, 7), make_request(setup, 1, 1)]
        return {
            0: pair[::-1] if one_frame_first else pair,
            2: [make_request(setup, 2, 5)],
            4: [make_request(setup, 3, 6), make_request(setup, 4, 3)],
        }

    usual, usual_first = run_timed(new_engine(setup, rows=4, overlap=True), arrivals())
    for one_frame_first in (False, True):
        engine = new_engine(setup, rows=4, overlap=True, first_frame_rows=4)
        runner, splits = engine.runner, []
        split, advance = runner.complete_first_frames, runner._advance_into_output

        def split_step(batch, span):
            splits.append(batch)
            return split(batch, span)

        def advance_after_the_copy(batch, span):
            # In a split step the host's copy of the frames is taken before the backbone advances.
            if splits and splits[-1] is not None:
                rows = splits[-1]
                assert torch.equal(runner.first_frames[:rows, :-1], runner.step_output[:rows, :-1])
                splits[-1] = None
            advance(batch, span)

        runner.complete_first_frames, runner._advance_into_output = split_step, advance_after_the_copy
        early, early_first = run_timed(engine, arrivals(one_frame_first))
        assert usual.keys() == early.keys() == {f"r{i}" for i in range(5)}
        for name, codes in usual.items():
            np.testing.assert_array_equal(early[name], codes)
        assert early_first == {"r0": 0, "r1": 0, "r2": 2, "r3": 4, "r4": 4}
        assert usual_first == {name: step + 1 for name, step in early_first.items()}
        assert engine.running == [] and not engine.has_work
        assert splits and set(splits) == {None}  # every split step was checked

    # Two rows run from the start: never at most one.
    assert (
        run_timed(new_engine(setup, rows=4, overlap=True, first_frame_rows=1), arrivals())[1] == usual_first
    )
    not_light = new_engine(setup, rows=4, overlap=True, first_frame_rows=4)
    assert run_timed(not_light, arrivals(), first_frames_early=False)[1] == usual_first
    assert new_engine(setup, rows=4, overlap=False, first_frame_rows=4).first_frame_rows == 0


def test_a_deferred_advance_runs_first_in_the_next_step_with_the_same_codes(setup):
    """`step(defer_advance=True)`: a step whose every row returns its first frame early leaves its
    second part to the next call, which launches it before anything else (an admission's prefill
    included). Not a step with other rows (their frames would wait), nor one a row leaves at launch
    (its row is freed now). The codes, and the steps that return each first frame, are those of
    steps never deferred."""

    def arrivals():
        return {
            0: [make_request(setup, 0, 4)],  # alone: deferred
            1: [make_request(setup, 1, 3)],  # admitted after r0's deferred part, beside its next frame
            8: [make_request(setup, 2, 3), make_request(setup, 3, 2)],  # two first frames: deferred
            12: [make_request(setup, 4, 1)],  # leaves at launch: not
        }

    usual, usual_first = run_timed(new_engine(setup, rows=4, overlap=True, first_frame_rows=4), arrivals())
    engine = new_engine(setup, rows=4, overlap=True, first_frame_rows=4)
    runner, deferred_steps, calls = engine.runner, [], []
    step = engine.step

    def noted_step(*args, **kwargs):
        calls.append([])
        outputs = step(*args, **kwargs)
        if engine.deferred is not None:
            assert runner.advance_pending is not None
            deferred_steps.append(len(calls) - 1)
        return outputs

    def noted(name, work):
        def call(*args):
            calls[-1].append(name)
            return work(*args)

        return call

    engine.step = noted_step
    for name in ("advance", "decode", "prefill", "complete_first_frames"):
        setattr(runner, name, noted(name, getattr(runner, name)))
    deferred, deferred_first = run_timed(engine, arrivals(), defer_advance=True)
    assert deferred_steps == [0, 8]
    assert calls[0] == calls[8] == ["prefill", "complete_first_frames"]
    # The deferred part first, before r1's prefill.
    assert calls[1] == ["advance", "prefill", "complete_first_frames", "advance"]
    assert calls[9] == ["advance", "decode"]
    assert calls[12] == ["prefill", "complete_first_frames", "advance"]
    assert deferred.keys() == usual.keys() == {f"r{i}" for i in range(5)}
    for name, codes in usual.items():
        np.testing.assert_array_equal(deferred[name], codes)
    assert deferred_first == usual_first == {"r0": 0, "r1": 1, "r2": 8, "r3": 8, "r4": 12}
    assert engine.running == [] and engine.deferred is None and not engine.has_work


def test_a_request_cancelled_before_its_early_first_frame_is_read_gets_no_frame(setup):
    """Cancelled after its step launched and before the host read its first frame: no frame comes
    back for it, early or with the step, it ends "cancelled", and the other request runs on with the
    codes it has alone."""
    alone = run(new_engine(setup, rows=2, overlap=True), {0: [make_request(setup, 1, 4)]})
    engine = new_engine(setup, rows=2, overlap=True, first_frame_rows=2)
    cancelled, kept = make_request(setup, 0, 6), make_request(setup, 1, 4)
    read_codes = engine.runner.read_codes

    def cancel_then_read(codes, ready):
        if engine.in_flight is None:  # the first step's first frames, read before its overlap swap
            cancelled.cancelled = True
        return read_codes(codes, ready)

    engine.runner.read_codes = cancel_then_read
    codes = run(engine, {0: [cancelled, kept]})
    assert codes.keys() == {"r1"} and cancelled.finish_reason == "cancelled"
    np.testing.assert_array_equal(codes["r1"], alone["r1"])
    assert engine.running == [] and not engine.has_work


def test_every_code_is_drawn_with_the_noise_of_its_frame_and_codebook(setup, monkeypatch):
    """Each draw's noise is that of (seed, frame, codebook): codebook 0 of frame 0 at admission, then
    per frame step codebooks 1..15 of its frame (the code predictor) and codebook 0 of the next (the
    talker), whichever part of the step draws them."""
    from voxtriton.engine import model_runner
    from voxtriton.engine.sampling import fold_seed, noise_keys

    drawn, sample = [], model_runner.sample

    def recorded(logits, params, keys):
        drawn.append(int(keys[0]))
        return sample(logits, params, keys)

    monkeypatch.setattr(model_runner, "sample", recorded)
    request = make_request(setup, 0, frames=3)
    run(new_engine(setup, rows=1), {0: [request]})
    seed = torch.tensor([fold_seed(request.params.seed)])

    def key(frame, group):
        return int(noise_keys(seed, torch.tensor([[frame]]), torch.tensor([group]))[0, 0])

    steps = [[key(frame, group) for group in range(1, 16)] + [key(frame + 1, 0)] for frame in range(3)]
    assert drawn == [key(0, 0)] + [k for step in steps for k in step]


def test_an_early_first_frame_is_followed_by_the_official_end_of_speech(setup, tiny_checkpoint):
    """A talker that always prefers end-of-speech, first frames early: still two frames, the second
    ending the request."""
    config, _, prompts = setup
    backbone = load_backbone(tiny_checkpoint, config)
    backbone.talker.codec_head.register_forward_hook(
        lambda module, args, logits: logits.index_fill(-1, torch.tensor([config.talker.codec_eos_id]), 100.0)
    )
    runner = ModelRunner(backbone, max_rows=2, max_positions=256, max_text_tokens=64)
    engine = Engine(runner, max_running=2, overlap=True, first_frame_rows=2)
    params = GenerationParams.create(config.generation, 1000, temperature=0.0, max_frames=30)
    request = Request("eager", prompts.build("Stop soon.", "ryan"), params)
    codes, first_step = run_timed(engine, {0: [request]})
    assert (request.finish_reason, len(codes["eager"]), first_step) == ("eos", 2, {"eager": 0})


def test_prompts_padded_to_prefill_buckets_get_the_codes_of_exact_shapes(setup, overlap):
    """The padded prefill (static buffers, scratch cache, groups of the largest batch bucket: what
    the GPU replays as graphs) must not change a request's codes, also when it joins a running batch."""

    def arrivals():
        return {
            0: [make_request(setup, 0, 10)],
            1: [make_request(setup, i, 10) for i in (1, 2, 3, 4)],
        }

    exact = run(new_engine(setup), arrivals())
    engine = new_engine(setup, overlap=overlap)
    engine.runner.set_buckets([], [], prefill_batch_sizes=[1, 2], prefill_lengths=[16, 32])
    padded = run(engine, arrivals())
    assert exact.keys() == padded.keys() and len(exact) == 5
    for request_id, codes in exact.items():
        np.testing.assert_array_equal(padded[request_id], codes)


def test_step_timing_counts_admission_apart_from_the_decode(setup):
    engine = new_engine(setup)
    engine.add(make_request(setup, 0, frames=3))
    engine.step()
    admitting = engine.last_timing
    engine.step()
    steady = engine.last_timing
    assert admitting.admit_s > 0 and admitting.decode_s > 0
    assert steady.admit_s < admitting.admit_s  # nothing to admit: only the check
    assert steady.decode_device_s is None  # CUDA events exist only on a GPU


def test_admissions_and_moves_make_few_pytorch_calls_on_the_graph_path(setup):
    """Each PyTorch call on the engine thread can hand the GIL to another thread of the tts process
    for up to the switch interval, so admitting and moving rows must stay a few calls where the GPU
    replays graphs (counted here with each graphed method as one call)."""
    engine = new_engine(setup)
    engine.runner.set_buckets([1, 2, 4, 8], [512], prefill_batch_sizes=[1, 2, 4], prefill_lengths=[32, 64])
    for requests in ([make_request(setup, 0)], [make_request(setup, i) for i in (1, 2, 3)]):
        with CallCounter(engine.runner, GRAPHED) as counter:
            engine.runner.prefill(requests, 0)
        assert counter.calls <= 20, counter.calls
    with CallCounter(engine.runner, GRAPHED) as counter:
        engine.runner.move_row(2, 0, 40)
    assert counter.calls <= 6, counter.calls


def test_the_runner_looks_rotary_embeddings_up_bit_for_bit(setup):
    """The runner bounds every position (its KV cache, the predictor's 16), so the frame step's 16
    stack calls look cos and sin up instead of computing them in nine small kernels each: the same
    values, bit for bit, and over a hundred fewer PyTorch calls (kernels, on the GPU) per step."""
    engine = new_engine(setup)
    runner, talker = engine.runner, engine.runner.talker
    stacks = ((talker.model.rotary, runner.max_positions), (talker.code_predictor.model.rotary, 16))
    generator = torch.Generator().manual_seed(0)
    for rotary, length in stacks:
        assert rotary.table is not None and rotary.table[0].shape[0] >= length
        positions = torch.randint(0, length, (3, 2), generator=generator)
        looked_up = rotary(positions, runner.dtype)
        table, rotary.table = rotary.table, None
        try:
            computed = rotary(positions, runner.dtype)
        finally:
            rotary.table = table
        assert all(torch.equal(a, b) for a, b in zip(looked_up, computed))
    with CallCounter(runner) as with_tables:
        runner.decode(2, 64)
    tables = [rotary.table for rotary, _ in stacks]
    try:
        for rotary, _ in stacks:
            rotary.table = None
        with CallCounter(runner) as computing:
            runner.decode(2, 64)
    finally:
        for (rotary, _), table in zip(stacks, tables):
            rotary.table = table
    assert computing.calls - with_tables.calls >= 16 * 5, (computing.calls, with_tables.calls)


def test_a_rotary_table_holds_the_computed_bf16_values_and_only_grows():
    rotary = Rotary(128, 1e6)
    rotary.tabulate(4096, torch.bfloat16)
    positions = torch.randint(0, 4096, (64, 3), generator=torch.Generator().manual_seed(1))
    looked_up = rotary(positions, torch.bfloat16)
    assert looked_up[0].shape == (64, 1, 3, 128)
    assert all(torch.equal(a[:, 0], b) for a, b in zip(looked_up, rotary._compute(positions, torch.bfloat16)))
    table = rotary.table
    rotary.tabulate(16, torch.bfloat16)  # a runner with a shorter cache shares the model
    assert rotary.table is table
    float_values = rotary(positions, torch.float32)  # another dtype: computed, not looked up
    assert all(
        torch.equal(a[:, 0], b) for a, b in zip(float_values, rotary._compute(positions, torch.float32))
    )
