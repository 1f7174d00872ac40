"""End to end through a real tritonserver and tritonclient gRPC streaming (tiny random checkpoint)."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import re
import uuid
import wave

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from server_helpers import live_processes, start_server, stream_and_abandon, wait_for_metric
from voxtriton_client import StreamingWavWriter, TTSClient
from voxtriton_client.api import request_inputs

from voxtriton.scheduler.policy import SchedulerConfig

pytestmark = pytest.mark.server

TEXTS = [
    "Good morning, this is the first voice.",
    "A second sentence, somewhat longer than the first one.",
    "Three.",
    "Streaming speech should never stall.",
    "Numbers like 42 and 1999 are text too.",
    "Short.",
    "The seventh request asks for a different seed.",
    "And the eighth closes the set.",
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with start_server(tiny_checkpoint) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return TTSClient(server.grpc_url)


def test_one_tritonserver_holds_the_ports_and_a_second_start_is_refused(server):
    """One server per `with start_server(...)`. A second start on the same ports would launch a
    server that fails to bind them after loading its models, while the readiness check sees the
    first answer; stop() would then end only the second, and the first would run on unnoticed."""

    def grpc_port(process) -> str | None:
        words = process.arguments
        return next((words[i + 1] for i in range(len(words) - 1) if words[i] == "--grpc-port"), None)

    started_here = [
        pid
        for pid, child in live_processes().items()
        if child.parent == os.getpid() and grpc_port(child) == str(server.grpc_port)
    ]
    assert len(started_here) == 1
    with pytest.raises(RuntimeError, match=f"tritonserver already started on gRPC port {server.grpc_port}"):
        server.start()


def speak(client, text, seed, frames=40, **options):
    return client.synthesize(
        text,
        speaker="serena",
        seed=seed,
        max_frames=frames,
        ignore_eos=True,
        codes=True,
        info=True,
        **options,
    ).raise_for_error()


def test_streams_chunks_and_writes_a_valid_wav(client, tmp_path):
    path = tmp_path / "out.wav"
    with StreamingWavWriter(path) as wav:
        synthesis = client.synthesize(
            TEXTS[0],
            speaker="ryan",
            seed=1,
            max_frames=50,
            ignore_eos=True,
            codes=True,
            info=True,
            on_chunk=lambda chunk: wav.write(chunk.audio),
        )
    synthesis.raise_for_error()
    assert synthesis.completed
    assert len(synthesis.chunks) >= 3  # audio arrives in pieces, before the final response
    assert synthesis.codes.shape == (50, 16)
    assert len(synthesis.audio) == 50 * 1920
    assert np.all(np.abs(synthesis.audio) <= 1.0) and np.abs(synthesis.audio).max() > 0.01
    # chunks cover the frames in order, exactly once
    info = np.stack([c.info for c in synthesis.chunks])
    assert list(info[:, 0]) == list(range(len(info)))
    assert list(info[:, 1]) == list(np.cumsum([0] + list(info[:-1, 2])))
    with wave.open(str(path)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24000, 1, 2)
        assert reader.getnframes() == 50 * 1920
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), "<i2") / 32767.0
    assert np.abs(pcm - synthesis.audio).max() < 1e-4


def test_same_seed_alone_is_bit_identical(client):
    first, second = speak(client, TEXTS[1], seed=5), speak(client, TEXTS[1], seed=5)
    np.testing.assert_array_equal(first.codes, second.codes)
    np.testing.assert_array_equal(first.audio, second.audio)
    other = speak(client, TEXTS[1], seed=6)
    assert not np.array_equal(first.codes, other.codes)


def test_eight_concurrent_requests_match_their_solo_runs(client):
    solo = [speak(client, text, seed=100 + i, frames=20 + 4 * i) for i, text in enumerate(TEXTS)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda i: speak(client, TEXTS[i], seed=100 + i, frames=20 + 4 * i), range(8))
        )
    for alone, shared in zip(solo, together):
        np.testing.assert_array_equal(shared.codes, alone.codes)
        assert len(shared.audio) == len(alone.audio)
        assert np.abs(shared.audio - alone.audio).max() <= 1e-4


def test_first_chunk_is_urgent_and_chunks_grow(client):
    synthesis = speak(client, TEXTS[3], seed=9, frames=60)
    sizes = [int(c.info[2]) for c in synthesis.chunks]
    # The served default: on a GPU (the server's device is "auto") a lone stream starts with 1 frame.
    start = [1] if torch.cuda.is_available() else []
    schedule = (start + [SchedulerConfig().chunk_frames(i) for i in range(len(sizes))])[: len(sizes)]
    assert sizes[:-1] == schedule[:-1] and sizes[-1] <= schedule[-1] and sum(sizes) == 60
    assert synthesis.chunks[0].info[3] == 0  # urgent lane


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_abandoned_streams_free_their_rows(server, client, how):
    wait_for_metric(server, "voxtriton_active_streams", lambda v: v == 0)
    for _ in range(3):
        stream_and_abandon(server.grpc_url, TEXTS[0], after_chunks=2, how=how)
    # 1500 frames would take far longer than this on the tiny model: generation must have stopped.
    wait_for_metric(server, "voxtriton_active_streams", lambda v: v == 0, timeout=30)
    wait_for_metric(server, "voxtriton_kv_rows_in_use", lambda v: v == 0, timeout=30)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        burst = list(pool.map(lambda i: speak(client, TEXTS[i], seed=i, frames=12), range(6)))
    assert all(s.completed and s.codes.shape == (12, 16) for s in burst)


BAD_INPUTS = [
    (dict(text=""), "text: is empty"),
    (dict(text="a" * 100_000), "text: too long: 100000 bytes"),
    (dict(text=b"caf\xe9 au lait"), "text: not valid UTF-8"),
    (dict(text="hi", speaker="nobody"), "speaker: unknown speaker 'nobody'"),
    (dict(text="hi", language="klingon"), "language: unknown language 'klingon'"),
    (dict(text="hi", max_frames=0), "max_frames: must be between 1 and"),
    (dict(text="hi", max_frames=10_000_000), "max_frames: must be between 1 and"),
    (dict(text="hi", temperature=float("nan")), "temperature: must be a finite number"),
    (dict(text="hi", temperature=-1.0), "temperature: must be a finite number >= 0"),
    (dict(text="hi", top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (dict(text="hi", top_p=1.5), r"top_p: must be in \(0, 1\]"),
    (dict(text="hi", top_k=-3), "top_k: must be >= 0"),
]


def raw_request(url: str, inputs: list) -> str | None:
    """Send one streaming request with hand-built inputs; return the error message (None if it worked)."""
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            "tts", inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True
        )
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                return error.message()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream()
        client.close()


def string_input(name: str, value) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(
        np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)
    )
    return tensor


@pytest.mark.parametrize(
    "fields,message", BAD_INPUTS, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_INPUTS)]
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, client, fields, message):
    text = fields.pop("text")
    inputs = [string_input("text", text)] + request_inputs(grpcclient, "x", **fields)[1:]
    error = raw_request(server.grpc_url, inputs)
    assert error is not None and re.search(message, error), error
    assert speak(client, "still serving", seed=1, frames=3).completed


@pytest.mark.parametrize(
    "build,field",
    [
        (
            lambda: [string_input("text", "hi"), typed("temperature", np.array([0.5], np.float64), "FP64")],
            "temperature",
        ),
        (lambda: [string_input("text", "hi"), typed("seed", np.array([1, 2], np.int64), "INT64")], "seed"),
        (lambda: [typed("text", np.array([1.0], np.float32), "FP32")], "text"),
        (lambda: [string_input("speaker", "ryan")], "text"),
    ],
    ids=["dtype", "shape", "text-dtype", "missing-text"],
)
def test_wrong_dtype_or_shape_is_refused_naming_the_input(server, client, build, field):
    error = raw_request(server.grpc_url, build())
    assert error is not None and re.search(rf"\b{field}\b", error), error
    assert speak(client, "still serving", seed=2, frames=3).completed


def typed(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_metrics_are_exported(server, client):
    speak(client, TEXTS[2], seed=3, frames=30)
    samples = (
        wait_for_metric(server, "voxtriton_active_streams", lambda v: v == 0) is not None and server.metrics()
    )
    assert samples['voxtriton_chunks_total{lane="urgent"}'] >= 1
    assert "voxtriton_chunks_promoted_total" in samples
    calls = samples['voxtriton_codec_calls_total{lane="urgent"}']
    assert 1 <= calls <= samples['voxtriton_chunks_total{lane="urgent"}']
    assert (
        sum(samples[f'voxtriton_codec_frames_total{{lane="{lane}"}}'] for lane in ("urgent", "background"))
        >= 30
    )
    assert samples['voxtriton_codec_busy_seconds_total{lane="urgent"}'] > 0
    assert samples["voxtriton_ttfa_seconds_count"] >= 1
    assert 'voxtriton_lane_queue_depth{lane="background"}' in samples
    assert samples["voxtriton_rejected_requests_total"] == 0
    assert samples["voxtriton_waiting_requests"] == 0 and samples["voxtriton_kv_rows_in_use"] == 0
    assert samples["voxtriton_draining_streams"] == 0  # every stream has ended
