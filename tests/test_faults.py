"""Codec faults through real servers: a lane that raises, a lane whose process dies (test-only switch)."""

from __future__ import annotations

import concurrent.futures

import pytest
from server_helpers import start_server
from test_production import speak
from voxtriton_client import TTSClient

pytestmark = pytest.mark.server


@pytest.fixture(params=["1", "2"], ids=["one lane worker", "two lane workers"])
def faulty_server(tiny_checkpoint, request):
    # Every 7th call of the urgent codec raises; all chunks go there under `concurrent`.
    with start_server(
        tiny_checkpoint,
        policy="concurrent",
        parameters={"codec_urgent": {"test_fault": "raise:7"}, "tts": {"lane_workers": request.param}},
    ) as running:
        yield running


def test_a_raising_codec_fails_only_the_requests_it_was_serving(faulty_server):
    client = TTSClient(faulty_server.grpc_url)
    results = [speak(client, seed=i, frames=10) for i in range(10)]
    failed = [r for r in results if r.error]
    good = [r for r in results if not r.error]
    assert failed and good
    assert all(
        "codec lane 'urgent' failed" in r.error and "injected codec fault" in r.error for r in failed
    ), [r.error for r in failed]
    assert all(r.completed and len(r.audio) == 10 * 1920 for r in good)


@pytest.fixture(params=["1", "2"], ids=["one lane worker", "two lane workers"])
def crashing_server(tiny_checkpoint, request):
    # The urgent codec's process exits at its 3rd call (once); voxtriton must reload it, once, also
    # when two calls were out at that lane.
    with start_server(
        tiny_checkpoint,
        policy="concurrent",
        parameters={"codec_urgent": {"test_fault": "exit:3"}, "tts": {"lane_workers": request.param}},
    ) as running:
        yield running


def test_a_dead_codec_process_fails_its_requests_and_is_replaced(crashing_server):
    client = TTSClient(crashing_server.grpc_url)
    # Three at a time, so that with two lane workers a second call is out when the process dies.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # 4 frames = 2 codec calls each
        results = list(pool.map(lambda seed: speak(client, seed=seed, frames=4), range(6)))
    failed = [i for i, r in enumerate(results) if r.error]
    assert failed, "the injected crash should fail the request it hit"
    assert all("codec_urgent" in results[i].error for i in failed)
    after = [speak(client, seed=10 + i, frames=8) for i in range(3)]
    assert all(r.completed and not r.error for r in after), [r.error for r in after]
    log = crashing_server.log_file.read_text(errors="replace")
    assert log.count("codec_urgent: its process is gone; reloading the model") == 1, (
        crashing_server.log_tail()
    )
