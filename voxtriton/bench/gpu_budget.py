"""The GPU time a serving probe asks for, priced at the backbone's and the codec's speeds alone."""

from __future__ import annotations

from voxtriton.bench.timing import call_shape
from voxtriton.scheduler.policy import SchedulerConfig

FRAME_SECONDS = SchedulerConfig().frame_seconds


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through sorted points, extended along the end segments."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def backbone_ms_per_audio_s(model_speed: dict, batch: float) -> float:
    """GPU ms of frame steps per second of audio, each step producing one frame per row."""
    step_ms = interpolate([(row["batch"], row["frame_step_ms"]) for row in model_speed["rows"]], batch)
    return step_ms / batch / FRAME_SECONDS


def codec_ms_per_audio_s(codec_speed: dict) -> dict[str, float]:
    """GPU ms per second of audio decoded, per call shape (BATCHxFRAMES)."""
    result = {}
    for shape, ms in codec_speed["ms"].items():
        batch, frames = call_shape(shape)
        result[shape] = ms / (batch * frames * FRAME_SECONDS)
    return result


def budget(probe: dict, model_speed: dict, codec_per_audio_s: float) -> dict:
    audio_per_request = probe["audio_s"] / probe["completed"]
    demand = probe["rate"] * audio_per_request  # seconds of audio per second
    backbone = backbone_ms_per_audio_s(model_speed, probe["frame_step_batch"])
    gpu_s_per_s = demand * (backbone + codec_per_audio_s) / 1e3
    return {
        "audio_s_per_request": audio_per_request,
        "demand_audio_s_per_s": demand,
        "backbone_ms_per_audio_s": backbone,
        "codec_ms_per_audio_s": codec_per_audio_s,
        "gpu_s_per_s": gpu_s_per_s,
        "rate_filling_gpu": probe["rate"] / gpu_s_per_s,
    }


def ceilings(model_speed: dict, codec_per_audio_s: float, audio_per_request: float) -> list[dict]:
    """Per measured batch: the request rates the backbone alone, and backbone then codec, sustain."""
    rows = []
    for row in sorted(model_speed["rows"], key=lambda r: r["batch"]):
        backbone = backbone_ms_per_audio_s(model_speed, row["batch"])
        rows.append(
            {
                "batch": row["batch"],
                "frame_step_ms": row["frame_step_ms"],
                "backbone_alone": 1e3 / (backbone * audio_per_request),
                "backbone_then_codec": 1e3 / ((backbone + codec_per_audio_s) * audio_per_request),
            }
        )
    return rows
