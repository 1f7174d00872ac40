"""Every policy, through a real server: the same codes and audio for the same seeds, chunks in order."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from server_helpers import start_server
from voxtriton_client import TTSClient

pytestmark = pytest.mark.server

REQUESTS = [
    ("Policies change timing, never content.", 11, 45),
    ("A second voice joins.", 12, 30),
    ("Third stream, shorter.", 13, 18),
    ("The fourth one talks the longest of them all.", 14, 60),
]


def run_all(url: str) -> list:
    client = TTSClient(url)

    def one(item):
        text, seed, frames = item
        return client.synthesize(
            text, speaker="aiden", seed=seed, max_frames=frames, ignore_eos=True, codes=True, info=True
        ).raise_for_error()

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


def assert_warm_when_ready(server, policy: str) -> None:
    """Read when the server first reports ready, before any client's request: Triton's own counters
    show that the warm-up ran every codec model the policy decodes on, and only those, while
    voxtriton's client-facing metrics are still empty."""
    samples = server.metrics()
    executed = {
        model
        for model in ("codec_urgent", "codec_background")
        if samples.get(f'nv_inference_count{{model="{model}",version="1"}}', 0) > 0
    }
    assert executed == ({"codec_urgent", "codec_background"} if policy == "voxserve" else {"codec_urgent"})
    assert samples["voxtriton_ttfa_seconds_count"] == 0
    assert all(
        samples[f'voxtriton_chunks_total{{lane="{lane}"}}'] == 0
        for lane in ("urgent", "background", "inline")
    )
    assert all(
        samples[f'voxtriton_codec_calls_total{{lane="{lane}"}}'] == 0 for lane in ("urgent", "background")
    )


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint):
    with start_server(tiny_checkpoint, policy="voxserve") as server:
        assert_warm_when_ready(server, "voxserve")
        return run_all(server.grpc_url)


@pytest.mark.parametrize(
    "policy, parameters",
    [
        ("concurrent", None),
        ("serial", None),
        ("disaggregated", None),
        ("voxserve", {"tts": {"lane_workers": "1", "switch_interval_ms": "0.5"}}),
        (
            "voxserve",
            {
                "tts": {
                    "scheduler_background_fullest_size": "false",
                    "scheduler_idle_urgent_takes_frames": "16",
                }
            },
        ),
        ("voxserve", {"tts": {"scheduler_catch_up": "true"}}),
        ("voxserve", {"tts": {"scheduler_single_frame_start_streams": "8"}}),
    ],
)
def test_policy_changes_timing_not_content(tiny_checkpoint, baseline, policy, parameters):
    """The baseline runs the defaults: two calls in flight per codec lane (BLS calls from two threads
    to one codec model) and the background lane's fullest size. Also one call in flight (with a
    shorter GIL switch interval), the other batching rules, and the catch-up option set through the
    config (on this CPU the backbone rarely runs ahead of the codec, so its chunks mostly follow the
    schedule; test_tts_service makes it catch up), and 1-frame first chunks (4 streams: a light load
    by the setting). Each server is warm when it reports ready."""
    with start_server(tiny_checkpoint, policy=policy, parameters=parameters) as server:
        assert_warm_when_ready(server, policy)
        results = run_all(server.grpc_url)
    if policy == "voxserve":
        assert_both_lanes_in_order(results)
    expected_lane = {"serial": {2}, "voxserve": {0, 1}}.get(policy, {0})
    for (_, _, frames), reference, result in zip(REQUESTS, baseline, results):
        np.testing.assert_array_equal(result.codes, reference.codes)
        assert result.codes.shape == (frames, 16)
        assert np.abs(result.audio - reference.audio).max() <= 1e-4
        info = np.stack([c.info for c in result.chunks])
        assert list(info[:, 0]) == list(range(len(info)))  # in order, exactly once
        assert info[:, 2].sum() == frames
        assert set(info[:, 3]) <= expected_lane
        if "scheduler_single_frame_start_streams" in (parameters or {}).get("tts", {}):
            assert list(info[:3, 2]) == [1, 2, 2]


def test_voxserve_uses_both_lanes_and_keeps_order(baseline):
    assert_both_lanes_in_order(baseline)


def assert_both_lanes_in_order(results) -> None:
    lanes = set()
    for (_, _, frames), result in zip(REQUESTS, results):
        info = np.stack([c.info for c in result.chunks])
        assert list(info[:, 0]) == list(range(len(info)))
        assert list(info[:, 1]) == list(np.cumsum([0] + list(info[:-1, 2])))
        assert info[0, 3] == 0  # first chunk urgent
        lanes |= set(info[:, 3])
    assert lanes == {0, 1}
