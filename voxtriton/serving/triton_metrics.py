"""voxtriton's metrics on Triton's metrics endpoint (Python-backend custom metrics, Prometheus format)."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from ..scheduler.policy import BACKGROUND, INLINE, URGENT

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
LANES = (URGENT, BACKGROUND, INLINE)


class TritonMetrics:
    """Implements tts_service.ServiceMetrics."""

    def __init__(self):
        # Metric families must outlive their metrics, so they are kept here.
        self.families = []

        def _family(name, description, kind):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self.families[-1]

        counter, gauge, histogram = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
        ttfa = _family("voxtriton_ttfa_seconds", "Server-side time to first audio: request received to first chunk sent", histogram)
        self.ttfa = ttfa.Metric(labels={}, buckets=LATENCY_BUCKETS)
        chunks = _family("voxtriton_chunks_total", "Audio chunks sent, by codec lane", counter)
        self.chunks = {lane: chunks.Metric(labels={"lane": lane}) for lane in LANES}
        codec = _family("voxtriton_codec_seconds", "Codec decode call latency (one batch of chunks), by lane", histogram)
        self.codec = {lane: codec.Metric(labels={"lane": lane}, buckets=LATENCY_BUCKETS) for lane in LANES}
        self.first_codec = _family("voxtriton_first_chunk_codec_seconds", "Codec call latency of calls holding a first chunk",
                                   histogram).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.step = _family("voxtriton_frame_step_seconds", "Backbone frame step (all running requests advance one frame)",
                            histogram).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.step_device = _family("voxtriton_frame_step_device_seconds",
                                   "The frame step's decode as timed on the GPU (CUDA events; not reported on CPU)",
                                   histogram).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.step_batch = _family("voxtriton_frame_step_batch", "Requests in a backbone frame step", histogram).Metric(
            labels={}, buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
        depth = _family("voxtriton_lane_queue_depth", "Chunks waiting for a codec lane", gauge)
        self.depth = {lane: depth.Metric(labels={"lane": lane}) for lane in LANES}
        self.active = _family("voxtriton_active_streams", "Streams admitted and not yet finished", gauge).Metric(labels={})
        self.rows = _family("voxtriton_kv_rows_in_use", "Requests holding a KV-cache row (generating)", gauge).Metric(labels={})
        self.rejected_total = _family("voxtriton_rejected_requests_total", "Requests refused by admission control (server busy)",
                                      counter).Metric(labels={})
        self.misses = _family("voxtriton_deadline_misses_total",
                              "Chunks sent after their stream's playback deadline (a listener would have stalled)",
                              counter).Metric(labels={})
        self._misses_seen = 0

    def chunk_sent(self, lane, frames, decode_s, first, since_submit_s):
        self.chunks[lane].increment(1)
        self.codec[lane].observe(decode_s)
        if first:
            self.ttfa.observe(since_submit_s)
            self.first_codec.observe(decode_s)

    def frame_step(self, seconds, batch, decode_device_s):
        self.step.observe(seconds)
        self.step_batch.observe(batch)
        if decode_device_s is not None:
            self.step_device.observe(decode_device_s)

    def rejected(self):
        self.rejected_total.increment(1)

    def gauges(self, active, rows, queues, deadline_misses):
        self.active.set(active)
        self.rows.set(rows)
        for lane, depth in queues.items():
            self.depth[lane].set(depth)
        if deadline_misses > self._misses_seen:
            self.misses.increment(deadline_misses - self._misses_seen)
            self._misses_seen = deadline_misses
