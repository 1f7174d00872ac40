"""A probe seen from its listeners: each request's TTFA, stall and late chunks, and their summary."""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass

from voxtriton.serving.tts_service import LANE_CODES

TTFA_TARGET_S = 0.2
SLO_ATTAINMENT_PERCENT = 99  # of requests that must start within TTFA_TARGET_S and never stall
# A completed stream with less audio than this share of its fixed length counts as failed (one frame
# less than asked, as a server may send, is over 99% of the shortest utterance).
MIN_AUDIO_FRACTION = 0.9
TIMELINE_WINDOW_S = 2.0  # each probe's timeline: requests, stalls and p90 TTFA per 2 s of arrivals
LANES = tuple(sorted(LANE_CODES, key=LANE_CODES.get))  # chunk_info's lane codes, in order


@dataclass
class RequestResult:
    sent_at: float
    ttfa_s: float | None
    stall_s: float
    audio_s: float
    rtf: float | None
    error: str | None
    late: tuple[
        tuple[int, str], ...
    ] = ()  # (chunk index, codec lane) of each chunk that arrived after the buffer ran dry
    asked_s: float | None = None  # the audio the request asked for (its fixed length)
    text_end_to_audio_end_s: float | None = None  # input streaming: last text piece sent to last audio

    def attains_slo(self) -> bool:
        """Completed, first audio within TTFA_TARGET_S, and played without a stall."""
        return (
            self.error is None
            and self.ttfa_s is not None
            and self.ttfa_s <= TTFA_TARGET_S
            and self.stall_s == 0
        )


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value at least q% of the values are at or below (of 88 values, p99
    is the largest: a rounded index would give the second largest and hide the one slow request)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def peak_listeners(results: list[RequestResult]) -> int:
    """Most listeners playing at once: each plays from its first audio to the end of its audio
    (stalls included), on the client's clock."""
    events = []
    for r in results:
        if r.error is None and r.ttfa_s is not None:
            start = r.sent_at + r.ttfa_s
            events += [(start, 1), (start + r.audio_s + r.stall_s, -1)]
    playing = peak = 0
    for _, change in sorted(events):  # at equal times an end (-1) sorts before a start
        playing += change
        peak = max(peak, playing)
    return peak


def timeline(results: list[RequestResult], window_s: float = TIMELINE_WINDOW_S) -> list[dict]:
    """Per window of send time, from the probe's first request: the requests sent in it, how many of
    them stalled or failed, and their p90 TTFA. A request counts in the window it was sent in, even
    if it stalled seconds later, so this dates a collapse by the arrivals it hit, and shows how many
    arrived just before (the aggregates of a collapsed probe can look like a passing one's)."""
    if not results:
        return []
    origin = min(r.sent_at for r in results)
    windows = collections.defaultdict(list)
    for r in results:
        windows[int((r.sent_at - origin) // window_s)].append(r)
    rows = []
    for index in range(max(windows) + 1):
        sent = windows.get(index, [])
        ok = [r for r in sent if r.error is None]
        ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
        rows.append(
            {
                "start_s": index * window_s,
                "requests": len(sent),
                "failed": len(sent) - len(ok),
                "stalled": sum(r.stall_s > 0 for r in ok),
                "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
            }
        )
    return rows


def summarize(results: list[RequestResult], lag: list[float]) -> dict:
    ok = [r for r in results if r.error is None]
    ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    stalled = [r for r in ok if r.stall_s > 0]
    attained = sum(r.attains_slo() for r in results)
    text_end = [r.text_end_to_audio_end_s for r in ok if r.text_end_to_audio_end_s is not None]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "ttfa_p50_ms": _ms(percentile(ttfa, 50)),
        "ttfa_p90_ms": _ms(percentile(ttfa, 90)),
        "ttfa_p99_ms": _ms(percentile(ttfa, 99)),
        # Input streaming (--text-rate): from the last text piece sent to the last audio received.
        "text_end_to_audio_end_p50_ms": _ms(percentile(text_end, 50)),
        "text_end_to_audio_end_p90_ms": _ms(percentile(text_end, 90)),
        "stalled_requests": len(stalled),
        "stalled_fraction": len(stalled) / len(ok) if ok else None,
        "stall_total_s": sum(r.stall_s for r in ok),
        # Where stalls start: late chunks by their position in the stream (0 is the first) and by lane.
        "late_chunks_by_index": dict(sorted(collections.Counter(i for r in ok for i, _ in r.late).items())),
        "late_chunks_by_lane": dict(collections.Counter(lane for r in ok for _, lane in r.late)),
        "rtf_median": statistics.median(rtf) if rtf else None,
        "audio_s": sum(r.audio_s for r in ok),
        "audio_asked_s": sum(r.asked_s for r in ok) if all(r.asked_s is not None for r in ok) else None,
        # SLO attainment: the share of all requests (failed ones count against it) that attain the SLO.
        "slo_attained": attained,
        "slo_attainment": attained / len(results) if results else None,
        "listeners_peak": peak_listeners(results),
        "client_loop_lag_p99_ms": _ms(percentile(lag, 99)),
        "client_loop_lag_max_ms": _ms(max(lag) if lag else None),
        "timeline": timeline(results),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def meets_target(summary: dict) -> bool:
    """The strict verdict: nothing failed, nothing stalled, p90 TTFA within the target."""
    return (
        summary["failed"] == 0
        and summary["stalled_requests"] == 0
        and summary["ttfa_p90_ms"] is not None
        and summary["ttfa_p90_ms"] <= TTFA_TARGET_S * 1e3
    )


def attains_target(summary: dict) -> bool | None:
    """The SLO-attainment verdict: at least 99% of requests attain the SLO; None for a probe summarized
    before the harness counted attainment."""
    if "slo_attained" not in summary:
        return None
    # In integers: 99 of 100 passes exactly, whatever the float rounding of 0.99 * n would say.
    return (
        summary["requests"] > 0
        and 100 * summary["slo_attained"] >= SLO_ATTAINMENT_PERCENT * summary["requests"]
    )


def verdicts(summary: dict) -> dict:
    """Both goodput definitions' verdicts on one probe."""
    return {"meets": meets_target(summary), "attains": attains_target(summary)}
