"""Every policy, through a real server: the same codes and audio for the same seeds, chunks in order."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from server_helpers import start_server, wait_for_metric
from voxtriton_client import TTSClient

pytestmark = pytest.mark.server

REQUESTS = [("Policies change timing, never content.", 11, 45), ("A second voice joins.", 12, 30),
            ("Third stream, shorter.", 13, 18), ("The fourth one talks the longest of them all.", 14, 60)]


def run_all(url: str) -> list:
    client = TTSClient(url)

    def one(item):
        text, seed, frames = item
        return client.synthesize(text, speaker="aiden", seed=seed, max_frames=frames, ignore_eos=True, codes=True,
                                 info=True).raise_for_error()

    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint):
    with start_server(tiny_checkpoint, policy="voxserve") as server:
        return run_all(server.grpc_url)


@pytest.mark.parametrize("policy, parameters", [("concurrent", None), ("serial", None), ("disaggregated", None),
                                                ("voxserve", {"tts": {"lane_workers": "2"}}),
                                                ("voxserve", {"tts": {"scheduler_mix_sizes": "true",
                                                                      "scheduler_background_fullest_size": "true",
                                                                      "scheduler_idle_urgent_takes_frames": "16"}})])
def test_policy_changes_timing_not_content(tiny_checkpoint, baseline, policy, parameters):
    """Also with two calls in flight per codec lane (BLS calls from two threads to one codec model),
    and with the optional batching rules (mixed chunk sizes go to the codec with each row's length)."""
    with start_server(tiny_checkpoint, policy=policy, parameters=parameters) as server:
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


def test_a_shorter_chunk_shares_a_longer_ones_codec_call_through_bls(tiny_checkpoint):
    """Schedule 4,2 with mixed sizes, and a codec that takes 3 s a call: r1's second chunk (2
    frames) waits behind r2's first (4 frames) and joins its call, padded to 4 frames (the frame
    counter counts them). Both streams still get exactly their solo audio."""
    parameters = {"tts": {"scheduler_mix_sizes": "true", "scheduler_chunk_schedule": "4,2"},
                  "codec_urgent": {"test_fault": "delay:3000"}}
    items = [("Mixed through the server.", 21, 6), ("Joined a moment later.", 22, 6)]
    with start_server(tiny_checkpoint, policy="concurrent", parameters=parameters) as server:
        client = TTSClient(server.grpc_url)
        one = lambda item: client.synthesize(item[0], speaker="aiden", seed=item[1], max_frames=item[2],
                                             ignore_eos=True, codes=True, info=True).raise_for_error()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(one, items[0])
            time.sleep(1.5)  # r1's first call (3 s) is out when r2 arrives, even on a slow host
            second = pool.submit(one, items[1])
            results = [first.result(), second.result()]
        # Calls [r1 4], [r2 4 + r1 2 padded to 4], [r2 2]: 14 frames decoded for 12 sent (12 without
        # the mixed call). The metrics are published a moment after the calls.
        name = 'voxtriton_codec_frames_total{lane="urgent"}'
        assert wait_for_metric(server, name, lambda frames: frames >= 14) == 14
    with start_server(tiny_checkpoint, policy="concurrent", parameters={"tts": {"scheduler_chunk_schedule": "4,2"}}) as server:
        client = TTSClient(server.grpc_url)
        alone = [one(item) for item in items]
    for result, reference in zip(results, alone):
        np.testing.assert_array_equal(result.codes, reference.codes)
        assert np.abs(result.audio - reference.audio).max() <= 1e-4
