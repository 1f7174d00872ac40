"""voxtriton's metrics on Triton's metrics endpoint (Python-backend custom metrics, Prometheus format).

Every metric update of the Python backend is a round trip to the server process that releases the
GIL, and a thread that released the GIL waits up to the interpreter's switch interval to get it back
while another thread runs Python. On the engine thread or under the service lock that delay lands on
every stream's frame period, so updates are only queued there; a writer thread of their own applies
them (within `flush_interval_s`).
"""

from __future__ import annotations

import collections
import logging
import threading

import triton_python_backend_utils as pb_utils

from ..scheduler.policy import BACKGROUND, INLINE, URGENT

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
LANES = (URGENT, BACKGROUND, INLINE)


class QueuedMetrics:
    """Metric families, and updates queued for a writer thread of their own (see the module's
    docstring): `_updates` takes (metric, "observe" | "increment", value) in order, `_gauge_values`
    each gauge's latest value. A subclass starts `_writer` once its families are made."""

    def __init__(self, flush_interval_s: float = 0.1):
        # Metric families must outlive their metrics, so they are kept here.
        self.families = []
        # Bounded so a stalled writer cannot grow memory without limit (the oldest updates go first).
        self._updates: collections.deque = collections.deque(maxlen=100_000)
        self._gauge_values: dict = {}
        self._gauges_set: dict = {}
        self._stop = threading.Event()
        self._writer = threading.Thread(
            target=self._write_loop, args=(flush_interval_s,), name="voxtriton-metrics", daemon=True
        )

    def _family(self, name, description, kind: str):
        """kind: "COUNTER", "GAUGE" or "HISTOGRAM" (the stub defines `MetricFamily` after importing the
        model's module, so its kinds are read here)."""
        family = pb_utils.MetricFamily
        self.families.append(family(name=name, description=description, kind=getattr(family, kind)))
        return self.families[-1]

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._writer.join(timeout)

    def _write_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._write()
        self._write()

    def _write(self) -> None:
        """Apply what was queued: counters summed per metric (one round trip each), histogram values
        one by one, then the gauges read before the queue (so a gauge is never newer than the
        counters and histograms written with it)."""
        gauges = list(self._gauge_values.items())
        queue, increments = self._updates, {}
        for _ in range(len(queue)):
            metric, method, value = queue.popleft()
            if method == "increment":
                increments[metric] = increments.get(metric, 0) + value
            else:
                self._apply(metric, method, value)
        for metric, value in increments.items():
            self._apply(metric, "increment", value)
        for metric, value in gauges:
            if self._gauges_set.get(metric) != value and self._apply(metric, "set", value):
                self._gauges_set[metric] = value

    def _apply(self, metric, method: str, value) -> bool:
        try:
            getattr(metric, method)(value)
            return True
        except Exception as error:  # a metric must never take the writer (and every later update) down
            log.warning("metric update %s(%s) failed: %s", method, value, error)
            return False


class CodecModelMetrics(QueuedMetrics):
    """A codec model's own time per call, beside Triton's (`nv_inference_compute_infer_duration_us`,
    which adds the round trip to its Python process): the model's work on a request, and the
    decode within it."""

    def __init__(self, model: str, flush_interval_s: float = 0.1):
        super().__init__(flush_interval_s)
        labels = {"model": model}
        self.calls = self._family(
            "voxtriton_codec_model_calls_total", "Requests a codec model completed (decoded)", "COUNTER"
        ).Metric(labels=labels)
        seconds = self._family(
            "voxtriton_codec_model_seconds_total",
            "A codec model's time on its requests, by part: execute (the request's inputs to its "
            "response, in the model's process) and decode (the codec's work on the chunks within it)",
            "COUNTER",
        )
        self.seconds = {
            part: seconds.Metric(labels={**labels, "part": part}) for part in ("execute", "decode")
        }
        self._writer.start()

    def call(self, execute_s: float, decode_s: float) -> None:
        queue = self._updates
        queue.append((self.calls, "increment", 1))
        queue.append((self.seconds["execute"], "increment", execute_s))
        queue.append((self.seconds["decode"], "increment", decode_s))


class TritonMetrics(QueuedMetrics):
    """Implements tts_service.ServiceMetrics."""

    def __init__(self, flush_interval_s: float = 0.1):
        super().__init__(flush_interval_s)
        _family = self._family
        counter, gauge, histogram = "COUNTER", "GAUGE", "HISTOGRAM"
        ttfa = _family(
            "voxtriton_ttfa_seconds",
            "Server-side time to first audio: request (an input stream's first text piece) received "
            "to first chunk sent",
            histogram,
        )
        self.ttfa = ttfa.Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.text_end_to_audio_end = _family(
            "voxtriton_text_end_to_audio_end_seconds",
            "Input streaming: an input stream's last text piece received to its last chunk sent",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.text_to_first_audio = _family(
            "voxtriton_text_to_first_audio_seconds",
            "Input streaming: the latest text piece the engine had taken when an input stream's first "
            "chunk was generated, received, to that chunk sent (the wait once the text it needed was there)",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.reference_encoding = _family(
            "voxtriton_reference_encoding_seconds",
            "Requests with reference_audio: received to voice encoded (waiting for the encoder "
            "thread, reading the recording, the encoders; a reference kept from before: its lookup)",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        chunks = _family("voxtriton_chunks_total", "Audio chunks sent, by codec lane", counter)
        self.chunks = {lane: chunks.Metric(labels={"lane": lane}) for lane in LANES}
        self.promoted = _family(
            "voxtriton_chunks_promoted_total",
            "Chunks queued for the background lane that ran "
            "out of slack there and were decoded on the urgent lane (voxserve)",
            counter,
        ).Metric(labels={})
        self.text_wait = _family(
            "voxtriton_chunks_text_wait_total",
            "Input streaming: chunks that a stream waiting for text sent with the frames it had, smaller "
            "than the schedule's next size, as its listener's buffer ran low",
            counter,
        ).Metric(labels={})
        codec = _family(
            "voxtriton_codec_seconds",
            "Codec decode call latency (one batch of chunks), by lane, observed once per chunk",
            histogram,
        )
        self.codec = {lane: codec.Metric(labels={"lane": lane}, buckets=LATENCY_BUCKETS) for lane in LANES}
        calls = _family("voxtriton_codec_calls_total", "Codec decode calls, by lane", counter)
        self.codec_calls = {lane: calls.Metric(labels={"lane": lane}) for lane in LANES}
        busy = _family(
            "voxtriton_codec_busy_seconds_total",
            "Time a lane spent in decode calls (its utilisation, as a rate)",
            counter,
        )
        self.codec_busy = {lane: busy.Metric(labels={"lane": lane}) for lane in LANES}
        frames = _family(
            "voxtriton_codec_frames_total",
            "Frames decoded, by lane (a short last chunk counts its padding: the work done)",
            counter,
        )
        self.codec_frames = {lane: frames.Metric(labels={"lane": lane}) for lane in LANES}
        self.first_codec = _family(
            "voxtriton_first_chunk_codec_seconds",
            "Codec call latency of calls holding a first chunk",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.step = _family(
            "voxtriton_frame_step_seconds",
            "Engine loop pass in which every running request advances "
            "one frame (the frame period while busy)",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        parts = _family(
            "voxtriton_frame_step_part_seconds_total",
            "Frame steps' wall time by part: admit (admitting "
            "prompts: uploads, prefill launch), decode (launching the frame step and waiting for the frames "
            "returned), other (locks, bookkeeping)",
            counter,
        )
        self.step_parts = {part: parts.Metric(labels={"part": part}) for part in ("admit", "decode", "other")}
        self.step_host_cpu = _family(
            "voxtriton_frame_step_host_cpu_seconds_total",
            "CPU time the engine thread used in its frame steps outside the decode (admitting, "
            "the service's per-frame work): the admit and other parts' wall time beyond it was "
            "spent waiting (for the GIL, the service lock, or a CPU). This thread's only: a GPU "
            "wait that spins counts, PyTorch's CPU threads do not",
            counter,
        ).Metric(labels={})
        self.admitted = _family(
            "voxtriton_admitted_requests_total",
            "Requests admitted into the frame steps "
            "(prompts prefilled): with the admit part above, the engine thread's time per admission",
            counter,
        ).Metric(labels={})
        self.prefill_device = _family(
            "voxtriton_prefill_device_seconds_total",
            "GPU time the steps' stream spent on admissions before their decodes: waiting "
            "for prefills and writing the admitted rows (CUDA events; not reported on CPU)",
            counter,
        ).Metric(labels={})
        self.step_device = _family(
            "voxtriton_frame_step_device_seconds",
            "The frame step's decode as timed on the GPU (CUDA events; not reported on CPU)",
            histogram,
        ).Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.step_batch = _family(
            "voxtriton_frame_step_batch", "Requests in a backbone frame step", histogram
        ).Metric(labels={}, buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
        primings = _family(
            "voxtriton_codec_primings_total",
            "In-context voices' codec states primed with their reference codes, by codec lane: "
            "decoded (a codec call) or reused (a registered voice's kept state copied)",
            counter,
        )
        self.primings = {
            (lane, reused): primings.Metric(labels={"lane": lane, "state": "reused" if reused else "decoded"})
            for lane in (URGENT, BACKGROUND)
            for reused in (False, True)
        }
        depth = _family("voxtriton_lane_queue_depth", "Chunks waiting for a codec lane", gauge)
        self.depth = {lane: depth.Metric(labels={"lane": lane}) for lane in LANES}
        self.active = _family(
            "voxtriton_active_streams", "Streams admitted and not yet finished", gauge
        ).Metric(labels={})
        self.rows = _family(
            "voxtriton_kv_rows_in_use", "Requests holding a KV-cache row (generating)", gauge
        ).Metric(labels={})
        self.waiting = _family(
            "voxtriton_waiting_requests",
            "Requests waiting for a free KV-cache row (max_streams reached)",
            gauge,
        ).Metric(labels={})
        self.draining = _family(
            "voxtriton_draining_streams",
            "Streams that have generated all their frames and "
            "still owe audio: each holds a codec state row, no KV-cache row (max_draining "
            "adds rows for them)",
            gauge,
        ).Metric(labels={})
        self.cancellation_checked = _family(
            "voxtriton_cancellation_checks_total",
            "Streams the cancellation watcher checked (a round trip to the server process each)",
            counter,
        ).Metric(labels={})
        self.cancellation_held = _family(
            "voxtriton_cancellation_lock_seconds_total",
            "Time the cancellation watcher held the service lock for its checks (getting "
            "the GIL back after each included): the engine thread and the codec lanes wait "
            "for it meanwhile",
            counter,
        ).Metric(labels={})
        self.held = _family(
            "voxtriton_first_chunk_hold_seconds_total",
            "Time the engine held its next frame step while a first chunk was decoded "
            "(scheduler_first_chunk_hold_s)",
            counter,
        ).Metric(labels={})
        self.holds = _family(
            "voxtriton_first_chunk_holds_total",
            "Frame steps the engine held while a first chunk was decoded (scheduler_first_chunk_hold_s)",
            counter,
        ).Metric(labels={})
        self.rejected_total = _family(
            "voxtriton_rejected_requests_total",
            "Requests refused by admission control (server busy)",
            counter,
        ).Metric(labels={})
        self.misses = _family(
            "voxtriton_deadline_misses_total",
            "Chunks sent after their stream's playback deadline (a listener would have stalled)",
            counter,
        ).Metric(labels={})
        self._misses_seen = 0
        self._writer.start()

    def chunk_sent(
        self,
        lane,
        frames,
        decode_s,
        first,
        since_submit_s,
        promoted=False,
        since_text_end_s=None,
        since_text_s=None,
        text_wait=False,
    ):
        queue = self._updates
        if since_text_end_s is not None:
            queue.append((self.text_end_to_audio_end, "observe", since_text_end_s))
        if since_text_s is not None:
            queue.append((self.text_to_first_audio, "observe", since_text_s))
        queue.append((self.chunks[lane], "increment", 1))
        if promoted:
            queue.append((self.promoted, "increment", 1))
        if text_wait:
            queue.append((self.text_wait, "increment", 1))
        queue.append((self.codec[lane], "observe", decode_s))
        if first:
            queue.append((self.ttfa, "observe", since_submit_s))
            queue.append((self.first_codec, "observe", decode_s))

    def codec_call(self, lane, frames, seconds):
        queue = self._updates
        queue.append((self.codec_calls[lane], "increment", 1))
        queue.append((self.codec_busy[lane], "increment", seconds))
        queue.append((self.codec_frames[lane], "increment", frames))

    def reference_encoded(self, seconds):
        self._updates.append((self.reference_encoding, "observe", seconds))

    def codec_primed(self, lane, reused):
        self._updates.append((self.primings[lane, reused], "increment", 1))

    def frame_step(self, seconds, batch, timing, host_cpu_s):
        queue = self._updates
        queue.append((self.step, "observe", seconds))
        queue.append((self.step_batch, "observe", batch))
        if timing.decode_device_s is not None:
            queue.append((self.step_device, "observe", timing.decode_device_s))
        if timing.admitted:
            queue.append((self.admitted, "increment", timing.admitted))
        if timing.prefill_device_s is not None:
            queue.append((self.prefill_device, "increment", timing.prefill_device_s))
        queue.append((self.step_parts["admit"], "increment", timing.admit_s))
        queue.append((self.step_parts["decode"], "increment", timing.decode_s))
        queue.append(
            (self.step_parts["other"], "increment", max(0.0, seconds - timing.admit_s - timing.decode_s))
        )
        queue.append((self.step_host_cpu, "increment", max(0.0, host_cpu_s)))

    def first_chunk_hold(self, seconds):
        self._updates.append((self.holds, "increment", 1))
        self._updates.append((self.held, "increment", seconds))

    def rejected(self):
        self._updates.append((self.rejected_total, "increment", 1))

    def cancellation_checks(self, streams, seconds):
        self._updates.append((self.cancellation_checked, "increment", streams))
        self._updates.append((self.cancellation_held, "increment", seconds))

    def gauges(self, active, rows, waiting, draining, queues, deadline_misses):
        values = self._gauge_values
        values[self.active], values[self.rows], values[self.waiting] = active, rows, waiting
        values[self.draining] = draining
        for lane, depth in queues.items():
            values[self.depth[lane]] = depth
        if deadline_misses > self._misses_seen:
            self._updates.append((self.misses, "increment", deadline_misses - self._misses_seen))
            self._misses_seen = deadline_misses
