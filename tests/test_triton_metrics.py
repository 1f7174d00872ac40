"""TritonMetrics' writer thread, with a recording stand-in for Triton's metric API (the real one
exists only inside the Python-backend stub; the server tests read the real endpoint)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from voxtriton.engine.engine import StepTiming


class RecordedMetric:
    def __init__(self, log, name, labels):
        self.log, self.name, self.labels, self.fail = log, name, labels, False

    def _record(self, method, value):
        if self.fail:
            raise RuntimeError("metric update refused")
        self.log.append((self.name, tuple(sorted(self.labels.items())), method, value))

    def increment(self, value):
        self._record("increment", value)

    def observe(self, value):
        self._record("observe", value)

    def set(self, value):
        self._record("set", value)


@pytest.fixture()
def metrics_module(monkeypatch):
    calls = []

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):  # noqa: N802 (Triton's name)
            return RecordedMetric(calls, self.name, labels)

    stand_in = types.ModuleType("triton_python_backend_utils")
    stand_in.MetricFamily = MetricFamily
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    monkeypatch.delitem(sys.modules, "voxtriton.serving.triton_metrics", raising=False)
    module = importlib.import_module("voxtriton.serving.triton_metrics")
    yield module, calls
    sys.modules.pop("voxtriton.serving.triton_metrics", None)


def test_updates_are_applied_by_the_writer_with_counters_summed_and_gauges_deduplicated(metrics_module):
    module, calls = metrics_module
    metrics = module.TritonMetrics(flush_interval_s=60)  # only close() flushes in this test
    metrics.chunk_sent("urgent", 2, 0.004, True, 0.09)
    metrics.chunk_sent("urgent", 4, 0.006, False, 0.2, promoted=True)
    metrics.chunk_sent("urgent", 8, 0.007, False, 0.3, promoted=True)
    metrics.chunk_sent("urgent", 2, 0.005, False, 0.4, text_wait=True)
    metrics.codec_call("background", 75, 0.04)
    metrics.codec_call("background", 50, 0.03)
    metrics.frame_step(
        0.03,
        5,
        StepTiming(admit_s=0.004, decode_s=0.02, decode_device_s=0.019, admitted=2, prefill_device_s=0.003),
        0.007,
    )
    metrics.frame_step(0.02, 5, StepTiming(admit_s=0.0, decode_s=0.02, decode_device_s=0.018), 0.0005)
    metrics.cancellation_checks(32, 0.0016)
    metrics.cancellation_checks(5, 0.0004)
    metrics.codec_primed("urgent", False)
    metrics.codec_primed("urgent", True)
    metrics.codec_primed("urgent", True)
    metrics.first_chunk_hold(0.003)
    metrics.first_chunk_hold(0.002)
    metrics.gauges(3, 2, 1, 0, {"urgent": 1, "background": 0, "inline": 0}, 0)
    metrics.gauges(3, 2, 0, 1, {"urgent": 0, "background": 0, "inline": 0}, 1)
    assert calls == []  # nothing on the caller's thread
    metrics.close()
    chunks = [c for c in calls if c[0] == "voxtriton_chunks_total"]
    assert chunks == [("voxtriton_chunks_total", (("lane", "urgent"),), "increment", 4)]  # one round trip
    assert [c[2:] for c in calls if c[0] == "voxtriton_chunks_promoted_total"] == [("increment", 2)]
    assert [c[2:] for c in calls if c[0] == "voxtriton_chunks_text_wait_total"] == [("increment", 1)]
    assert [c[3] for c in calls if c[0] == "voxtriton_codec_seconds"] == [0.004, 0.006, 0.007, 0.005]
    background = (("lane", "background"),)
    per_call = {c[0]: c[3] for c in calls if c[1] == background and c[0] != "voxtriton_lane_queue_depth"}
    assert per_call == pytest.approx(
        {
            "voxtriton_codec_calls_total": 2,
            "voxtriton_codec_busy_seconds_total": 0.07,
            "voxtriton_codec_frames_total": 125,
        }
    )
    assert [c[3] for c in calls if c[0] == "voxtriton_ttfa_seconds"] == [0.09]
    parts = {c[1][0][1]: c[3] for c in calls if c[0] == "voxtriton_frame_step_part_seconds_total"}
    assert parts == pytest.approx({"admit": 0.004, "decode": 0.04, "other": 0.006})
    assert [c[3] for c in calls if c[0] == "voxtriton_frame_step_host_cpu_seconds_total"] == pytest.approx(
        [0.0075]
    )
    assert [c[3] for c in calls if c[0] == "voxtriton_cancellation_checks_total"] == [37]
    assert [c[3] for c in calls if c[0] == "voxtriton_cancellation_lock_seconds_total"] == pytest.approx(
        [0.002]
    )
    assert [c[3] for c in calls if c[0] == "voxtriton_first_chunk_holds_total"] == [2]
    held = [c[3] for c in calls if c[0] == "voxtriton_first_chunk_hold_seconds_total"]
    assert held == pytest.approx([0.005])
    assert [c[3] for c in calls if c[0] == "voxtriton_frame_step_device_seconds"] == [0.019, 0.018]
    assert [c[2:] for c in calls if c[0] == "voxtriton_admitted_requests_total"] == [("increment", 2)]
    assert [c[3] for c in calls if c[0] == "voxtriton_prefill_device_seconds_total"] == pytest.approx([0.003])
    assert [c for c in calls if c[0] == "voxtriton_lane_queue_depth" and c[1] == (("lane", "urgent"),)] == [
        ("voxtriton_lane_queue_depth", (("lane", "urgent"),), "set", 0)
    ]  # only the latest value
    assert [c[2:] for c in calls if c[0] == "voxtriton_waiting_requests"] == [("set", 0)]
    assert [c[2:] for c in calls if c[0] == "voxtriton_draining_streams"] == [("set", 1)]
    assert [c[3] for c in calls if c[0] == "voxtriton_deadline_misses_total"] == [1]
    primings = {c[1]: c[2:] for c in calls if c[0] == "voxtriton_codec_primings_total"}
    assert primings == {
        (("lane", "urgent"), ("state", "decoded")): ("increment", 1),
        (("lane", "urgent"), ("state", "reused")): ("increment", 2),
    }


def test_a_failing_update_does_not_stop_the_writer(metrics_module):
    module, calls = metrics_module
    metrics = module.TritonMetrics(flush_interval_s=60)
    metrics.ttfa.fail = True
    metrics.chunk_sent("urgent", 2, 0.004, True, 0.09)
    metrics.rejected()
    metrics.close()
    assert [c[0] for c in calls] == [
        "voxtriton_codec_seconds",
        "voxtriton_first_chunk_codec_seconds",
        "voxtriton_chunks_total",
        "voxtriton_rejected_requests_total",
    ]


def test_a_codec_model_counts_its_calls_and_their_parts_by_model(metrics_module):
    module, calls = metrics_module
    metrics = module.CodecModelMetrics("codec_urgent", flush_interval_s=60)  # only close() flushes
    metrics.call(0.004, 0.003)
    metrics.call(0.002, 0.0015)
    metrics.close()
    urgent = (("model", "codec_urgent"),)
    assert [c[1:] for c in calls if c[0] == "voxtriton_codec_model_calls_total"] == [(urgent, "increment", 2)]
    seconds = {c[1]: c[3] for c in calls if c[0] == "voxtriton_codec_model_seconds_total"}
    assert seconds == {
        urgent + (("part", "decode"),): pytest.approx(0.0045),
        urgent + (("part", "execute"),): pytest.approx(0.006),
    }
