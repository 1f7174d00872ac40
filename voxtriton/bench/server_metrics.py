"""What the servers' metrics say about one measurement: differences of counters and histograms."""

from __future__ import annotations

import re

from voxtriton.bench.summary import LANES


def server_side(before: dict, after: dict, wall_s: float, servers: int = 1) -> dict:
    """Differences of voxtriton's counters and histograms (summed over `servers` servers) over one
    measurement of `wall_s` seconds."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(name, labels=""):
        count = delta.get(f"{name}_count{labels}", 0.0)
        return round(delta.get(f"{name}_sum{labels}", 0.0) / count * 1e3, 3) if count else None

    chunks = {lane: delta.get(f'voxtriton_chunks_total{{lane="{lane}"}}', 0.0) for lane in LANES}
    total = sum(chunks.values())
    steps = delta.get("voxtriton_frame_step_seconds_count", 0.0)
    admitted = delta.get("voxtriton_admitted_requests_total", 0.0)

    def per_admission(name):  # None where nothing was counted (the GPU time, on CPU)
        return round(delta[name] / admitted * 1e3, 3) if admitted and delta.get(name) else None

    return {
        "frame_step_ms_mean": mean("voxtriton_frame_step_seconds"),
        "frame_step_device_ms_mean": mean("voxtriton_frame_step_device_seconds"),  # GPU only
        # The frame step's wall time split (per step): prefill of new prompts, decode (launch to codes
        # on the host; the device time above is part of it), the rest (locks, bookkeeping, GIL waits).
        "frame_step_parts_ms_mean": {
            part: round(
                delta.get(f'voxtriton_frame_step_part_seconds_total{{part="{part}"}}', 0.0) / steps * 1e3, 3
            )
            if steps
            else None
            for part in ("admit", "decode", "other")
        },
        # The engine thread's CPU time per step outside the decode: admit and other beyond it were waits
        # (for the GIL, the service lock, a CPU).
        "frame_step_host_cpu_ms_mean": (
            round(delta["voxtriton_frame_step_host_cpu_seconds_total"] / steps * 1e3, 3)
            if steps and "voxtriton_frame_step_host_cpu_seconds_total" in delta
            else None
        ),
        # The engine thread's wall time and the GPU's time (before the decode) per admitted request.
        "admit_ms_per_request": per_admission('voxtriton_frame_step_part_seconds_total{part="admit"}'),
        "prefill_device_ms_per_request": per_admission("voxtriton_prefill_device_seconds_total"),
        "frame_step_batch_mean": (
            delta.get("voxtriton_frame_step_batch_sum", 0.0) / delta["voxtriton_frame_step_batch_count"]
            if delta.get("voxtriton_frame_step_batch_count")
            else None
        ),
        "codec_ms_mean": {lane: mean("voxtriton_codec_seconds", f'{{lane="{lane}"}}') for lane in chunks},
        "first_chunk_codec_ms_mean": mean("voxtriton_first_chunk_codec_seconds"),
        "chunks": chunks,
        "urgent_share": (chunks["urgent"] / total) if total else None,
        "promoted_chunks": delta.get(
            "voxtriton_chunks_promoted_total", 0.0
        ),  # background -> urgent (voxserve)
        # Per lane: calls, chunks and frames per call (batch occupancy), and the share of the
        # measurement the lane spent decoding (near 1: the lane is saturated).
        "codec_lanes": {
            lane: codec_lane(delta, lane, chunks[lane], wall_s * servers)
            for lane in LANES
            if delta.get(f'voxtriton_codec_calls_total{{lane="{lane}"}}')
        },
        "codec_models": triton_codec_models(delta),
        "server_ttfa_ms_mean": mean("voxtriton_ttfa_seconds"),
        # Input streaming: first audio after the text the first chunk waited for had arrived.
        "text_to_first_audio_ms_mean": mean("voxtriton_text_to_first_audio_seconds"),
        "codec_primings": codec_primings(delta),
        "deadline_misses": delta.get("voxtriton_deadline_misses_total", 0.0),
        "rejected": delta.get("voxtriton_rejected_requests_total", 0.0),
        "cancellation_watcher": cancellation_watcher(delta, wall_s * servers),
    }


def codec_primings(samples: dict) -> dict[str, float]:
    """In-context voices' codec primings, summed over the lanes: decoded (a codec call before the
    first audio) or reused (a registered voice's kept state)."""
    return {
        state: sum(
            value
            for key, value in samples.items()
            if key.startswith("voxtriton_codec_primings_total{") and f'state="{state}"' in key
        )
        for state in ("decoded", "reused")
    }


def cancellation_watcher(delta: dict, server_seconds: float) -> dict:
    """The cancellation watcher's checks per second and per server, the microseconds each took
    (holding the service lock), and the share of the measurement it held that lock: the engine
    thread and the codec lanes wait for it meanwhile."""
    if "voxtriton_cancellation_checks_total" not in delta or not server_seconds:  # (a server without them)
        return {"checks_per_s": None, "us_per_check": None, "lock_share": None}
    checks = delta["voxtriton_cancellation_checks_total"]
    held = delta["voxtriton_cancellation_lock_seconds_total"]
    return {
        "checks_per_s": round(checks / server_seconds, 1),
        "us_per_check": round(held / checks * 1e6, 1) if checks else None,
        "lock_share": round(held / server_seconds, 6),
    }


def triton_codec_models(delta: dict) -> dict:
    """Per codec model, Triton's own count of its calls and their mean ms: waiting in its queue (a
    lane's second call in flight waits there for the first), in the model's execution (the codec
    process's work and its round trip), and end to end. A lane times a call from when the codec was
    free (`_call_span`), so its mean call time (`codec_ms_mean`) less the execution time
    approximates what a call cost the tts process beyond Triton: the BLS round trip and getting the
    GIL back. The model's own figures (`voxtriton_codec_model_*`): `model_ms`, its work on a request
    in its process, of which `decode_ms` the codec's; the execution time less `model_ms` is the
    round trip between Triton and that process."""
    own = {}
    for key, value in delta.items():
        match = re.match(r"voxtriton_codec_model_(calls|seconds)_total\{(.*)\}$", key)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            own.setdefault(labels.get("model"), {})[labels.get("part", "calls")] = value
    models = {}
    for key, calls in delta.items():
        match = re.match(r'nv_inference_exec_count(\{model="codec[^"]*",version="[^"]*"\})$', key)
        if match and calls:
            labels = match.group(1)

            def per_call(part):
                return round(delta.get(f"nv_inference_{part}_duration_us{labels}", 0.0) / calls / 1e3, 3)

            name = re.search(r'model="([^"]*)"', labels).group(1)
            models[name] = {
                "calls": calls,
                "queue_ms": per_call("queue"),
                "execute_ms": per_call("compute_infer"),
                "request_ms": per_call("request"),
            }
            counted = own.get(name, {})
            if counted.get("calls"):
                for part, field in (("execute", "model_ms"), ("decode", "decode_ms")):
                    models[name][field] = round(counted.get(part, 0.0) / counted["calls"] * 1e3, 3)
    return models


def codec_lane(delta: dict, lane: str, chunks: float, lane_seconds: float) -> dict:
    """One lane's calls, occupancy and busy share; `lane_seconds`: the measurement's wall time times
    the servers whose counters were summed."""
    calls = delta[f'voxtriton_codec_calls_total{{lane="{lane}"}}']
    return {
        "calls": calls,
        "chunks_per_call": round(chunks / calls, 2),
        "frames_per_call": round(delta.get(f'voxtriton_codec_frames_total{{lane="{lane}"}}', 0.0) / calls, 1),
        "busy_fraction": round(
            delta.get(f'voxtriton_codec_busy_seconds_total{{lane="{lane}"}}', 0.0) / lane_seconds, 3
        ),
    }
