"""A server's chunk trace (tts `chunk_trace_path`) summarised: where late chunks lost their time."""

from __future__ import annotations

import collections
import gzip
import json
import statistics
from pathlib import Path


def read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def route(record: dict) -> str:
    """How a chunk reached its lane: the lane it was routed to, or "urgent/promoted" (queued for the
    background lane until its deadline neared) or "urgent/taken" (by an idle urgent lane). Traces
    from before the `taken` field lack it."""
    moved = "/promoted" if record["promoted"] else "/taken" if record.get("taken") else ""
    return record["lane"] + moved


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def quantile_ms(seconds: list[float], q: float) -> float | None:
    """The q-quantile of durations in seconds, in ms to 0.1 (None for none)."""
    return round(quantile(seconds, q) * 1e3, 1) if seconds else None


def step_windows(steps: list[dict], origin: float, window_s: float) -> dict:
    """Per time window, the frame steps that returned frames: the median period and batch, and the
    mean of each part (ms): host admission, launch + wait for the frames, the rest of the pass (the
    service's bookkeeping), and the GPU's own time for the frame step and for the prefills."""
    windows = collections.defaultdict(list)
    for step in steps:
        if step["frames"]:
            windows[int((step["end"] - origin) // window_s)].append(step)

    def mean_ms(values):
        return round(statistics.fmean(values) * 1e3, 1) if values else None

    table = {}
    for key, group in sorted(windows.items()):
        table[f"{key * window_s:g}s"] = {
            "steps": len(group),
            "period_ms_p50": round(statistics.median(s["period"] for s in group) * 1e3, 1),
            "frames_p50": statistics.median(s["frames"] for s in group),
            "admit_ms": mean_ms([s["admit_s"] for s in group]),
            "decode_ms": mean_ms([s["decode_s"] for s in group]),
            "other_ms": mean_ms([s["period"] - s["admit_s"] - s["decode_s"] for s in group]),
            "device_ms": mean_ms([s["decode_device_s"] for s in group if s["decode_device_s"] is not None]),
            # per step, counting steps without a prefill as 0
            "prefill_device_ms": mean_ms(
                [s["prefill_device_s"] or 0.0 for s in group if s["decode_device_s"] is not None]
            ),
            "admitted": sum(s["admitted"] for s in group),
        }
    return table


def codec_calls(records: list[dict]) -> dict[tuple[str, float, float], list[dict]]:
    """The chunks of each codec call, keyed by (lane, start, end)."""
    calls = collections.defaultdict(list)
    for record in records:
        calls[(record["lane"], record["start"], record["end"])].append(record)
    return calls


def lane_windows(records: list[dict], origin: float, window_s: float) -> dict:
    """Per time window (by call start) and lane: codec calls, chunks per call, and the calls' summed
    time as a share of the window (above 1 when a lane keeps several calls in flight)."""
    windows = collections.defaultdict(lambda: collections.defaultdict(list))
    for (lane, start, end), chunks in codec_calls(records).items():
        windows[int((start - origin) // window_s)][lane].append((end - start, len(chunks)))
    return {
        f"{key * window_s:g}s": {
            lane: {
                "calls": len(group),
                "chunks_per_call": round(statistics.fmean(c for _, c in group), 1),
                "busy": round(sum(d for d, _ in group) / window_s, 2),
            }
            for lane, group in sorted(lanes.items())
        }
        for key, lanes in sorted(windows.items())
    }


def lane_gaps(records: list[dict]) -> dict:
    """Per lane, over the whole trace: the gaps between the end of the calls so far and the next
    call's start (calls in start order), those where a chunk of the next call had been cut by then
    (the lane's host work) apart from the rest (nothing to decode), and the time from a call's end
    to the last of its chunks sent. Calls that overlap an earlier one (traces from before the
    server counted a queued call from the end of the call ahead of it) make no gap. And the lane's
    backlog: at each call's start, the chunks the same lane decoded later that had been cut by then
    (promoted and taken chunks left out: they waited on the other lane first), with their sizes."""
    by_lane = collections.defaultdict(list)
    for (lane, start, end), chunks in codec_calls(records).items():
        by_lane[lane].append(
            (start, end, min(c["cut"] for c in chunks), max(c["sent"] for c in chunks), len(chunks))
        )
    table = {}
    for lane, calls in sorted(by_lane.items()):
        calls.sort()
        working, idle, free_at = [], [], calls[0][1]
        for start, end, first_cut, _, _ in calls[1:]:
            if start >= free_at:
                (working if first_cut <= free_at else idle).append(start - free_at)
            free_at = max(free_at, end)
        sending = [sent - end for _, end, _, sent, _ in calls]
        backlog, sizes = lane_backlog(
            [r for r in records if r["lane"] == lane and route(r) == lane], [start for start, *_ in calls]
        )
        table[lane] = {
            "calls": len(calls),
            "call_ms_p50": quantile_ms([end - start for start, end, *_ in calls], 0.5),
            "gaps_with_work_waiting": len(working),
            "work_gap_ms_p50": quantile_ms(working, 0.5),
            "work_gap_ms_p90": quantile_ms(working, 0.9),
            "work_gaps_s": round(sum(working), 2),
            "idle_gaps": len(idle),
            "idle_gaps_s": round(sum(idle), 2),
            "send_after_call_ms_p50": quantile_ms(sending, 0.5),
            "send_after_call_ms_p90": quantile_ms(sending, 0.9),
            "chunks_per_call_p50": quantile([count for *_, count in calls], 0.5),
            "waiting_at_call_start_p50": quantile(backlog, 0.5),
            "waiting_at_call_start_p90": quantile(backlog, 0.9),
            "waiting_frames_mix": dict(sizes.most_common(5)),
        }
    return table


def lane_backlog(chunks: list[dict], starts: list[float]) -> tuple[list[int], collections.Counter]:
    """For each call start: how many of `chunks` had been cut and were not yet started; and how often
    each chunk size was among them."""
    chunks = sorted(chunks, key=lambda c: c["cut"])
    backlog, sizes, waiting, next_cut = [], collections.Counter(), [], 0
    for start in sorted(starts):
        while next_cut < len(chunks) and chunks[next_cut]["cut"] <= start:
            waiting.append(chunks[next_cut])
            next_cut += 1
        waiting = [c for c in waiting if c["start"] > start]
        backlog.append(len(waiting))
        sizes.update(c["frames"] for c in waiting)
    return backlog, sizes


FIRST_CHUNK_PARTS = {  # the server's part of TTFA, in order
    # a reference_audio's wait and encoders, or an input stream's wait for its first words (else 0)
    "submit": lambda r: _submitted(r) - r["arrived"],
    "generate": lambda r: r["cut"] - _submitted(r),  # admission, prefill and the first chunk's frames
    "lane_wait": lambda r: (
        r["start"] - r["cut"]
    ),  # for a lane worker, and in Triton's queue behind the lane's other call
    "codec": lambda r: r["end"] - r["start"],
    "send": lambda r: r["sent"] - r["end"],  # the sends of the call's chunks ahead of this one, and its own
    "total": lambda r: r["sent"] - r["arrived"],
}


def _submitted(record: dict) -> float:
    """When the service took the request (traces without the field: at its arrival)."""
    return record.get("submitted", record["arrived"])


def first_chunks(records: list[dict], origin: float, window_s: float) -> dict | None:
    """Where the server's part of TTFA goes: each part of every first chunk's path (p50, p90), the
    parts' means over the slowest tenth of first chunks (the tail that fails a p90 target), and per
    time window (by arrival) the p90 of the whole and of each part. For in-context voices primed
    ahead: when the priming ended against when the first chunk's frames were cut (above 0: the
    chunk waited for it, within its lane wait)."""
    firsts = [r for r in records if r["index"] == 0]
    if not firsts:
        return None
    primed = [r["primed"] - r["cut"] for r in firsts if r.get("primed") is not None]

    def parts(group, q):
        return {name: quantile_ms([part(r) for r in group], q) for name, part in FIRST_CHUNK_PARTS.items()}

    slowest = sorted(firsts, key=FIRST_CHUNK_PARTS["total"])[-max(1, len(firsts) // 10) :]
    windows = collections.defaultdict(list)
    for record in firsts:
        windows[int((record["arrived"] - origin) // window_s)].append(record)
    return {
        "count": len(firsts),
        "p50_ms": parts(firsts, 0.5),
        "p90_ms": parts(firsts, 0.9),
        "slowest_tenth_mean_ms": {
            name: round(statistics.fmean(part(r) for r in slowest) * 1e3, 1)
            for name, part in FIRST_CHUNK_PARTS.items()
        },
        "p90_ms_by_window": {
            f"{key * window_s:g}s": {"count": len(group), **parts(group, 0.9)}
            for key, group in sorted(windows.items())
        },
        "primed_after_cut_ms": {
            "count": len(primed),
            "p50": quantile_ms(primed, 0.5),
            "p90": quantile_ms(primed, 0.9),
        }
        if primed
        else None,
    }


LAST_CHUNK_PARTS = {  # an input stream's last word to its last audio, in order
    # the frames after the text's end (its last ids and the tail), or the stream's previous chunk
    "generate": lambda r: r["cut"] - r["text_ended"],
    "lane_wait": lambda r: r["start"] - r["cut"],
    "codec": lambda r: r["end"] - r["start"],
    "send": lambda r: r["sent"] - r["end"],
    "total": lambda r: r["sent"] - r["text_ended"],
}


def last_chunks(streams: dict[str, dict[int, dict]], steps: list[dict]) -> dict | None:
    """Where an input stream's last word to its last audio goes (the server's part, from its last
    piece's arrival): each part of the last chunk's path (p50, p90); the frame steps that ended
    between the text's end and the cut (every open stream takes a frame a step), their mean period;
    and how many last chunks were cut when their predecessor was done rather than at their frames."""
    lasts = []
    for chunks in streams.values():
        last = chunks[max(chunks)]
        if last.get("text_ended") is None:
            continue
        ends = [s["end"] for s in steps if last["text_ended"] < s["end"] <= last["cut"]]
        previous = chunks.get(last["index"] - 1)
        lasts.append((last, ends, previous is not None and previous["sent"] >= last["cut"] - 1e-4))
    if not lasts:
        return None
    parts = {
        q: {name: quantile_ms([part(r) for r, _, _ in lasts], q) for name, part in LAST_CHUNK_PARTS.items()}
        for q in (0.5, 0.9)
    }
    periods = [(e[-1] - e[0]) / (len(e) - 1) for _, e, _ in lasts if len(e) > 1]
    return {
        "count": len(lasts),
        "p50_ms": parts[0.5],
        "p90_ms": parts[0.9],
        "frames_p50": quantile([r["frames"] for r, _, _ in lasts], 0.5),
        "steps_after_text_p50": quantile([len(e) for _, e, _ in lasts], 0.5) if steps else None,
        "step_period_ms_p50": quantile_ms(periods, 0.5),
        "cut_at_previous_chunk": sum(after for _, _, after in lasts),
    }


def report(lines: list[dict], window_s: float = 4.0) -> dict:
    # Traces from before the step lines have chunk lines without a kind.
    records = [r for r in lines if r.get("kind", "chunk") == "chunk"]
    steps = [r for r in lines if r.get("kind") == "step"]
    streams: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for record in records:
        streams[record["stream"]][record["index"]] = record
    late = [r for r in records if r["index"] > 0 and r["sent"] > r["due"]]
    by_index = {}
    for index in range(1, 5):
        chunks = [(s[0], s[index]) for s in streams.values() if 0 in s and index in s]
        if not chunks:
            continue
        cut = [(c["cut"] - first["sent"]) * 1e3 for first, c in chunks]
        wait = [(c["start"] - c["cut"]) * 1e3 for _, c in chunks]
        by_index[index] = {
            "chunks": len(chunks),
            "cut_after_first_sent_ms_p50": round(quantile(cut, 0.5)),
            "cut_after_first_sent_ms_p99": round(quantile(cut, 0.99)),
            "lane_wait_ms_p50": round(quantile(wait, 0.5)),
            "lane_wait_ms_p99": round(quantile(wait, 0.99)),
        }
    # A fifth chunk cut well after the fourth was sent waited for its frames: one frame step each
    # since the fourth's cut (which, when it too waited for frames, came at its last frame).
    origin = min(r["arrived"] for r in records)
    periods = collections.defaultdict(list)
    for s in streams.values():
        if 3 in s and 4 in s and s[4]["cut"] - s[3]["sent"] > 0.005:
            periods[int((s[3]["cut"] - origin) // window_s)].append(
                (s[4]["cut"] - s[3]["cut"]) / s[4]["frames"] * 1e3
            )
    return {
        "chunks": len(records),
        "late": len(late),
        "late_by_index": dict(sorted(collections.Counter(r["index"] for r in late).items())),
        "late_by_lane": dict(collections.Counter(r["lane"] for r in late)),
        "chunks_by_route": dict(collections.Counter(map(route, records))),
        "late_by_route": dict(collections.Counter(map(route, late))),
        "late_arrived_s": [
            round(min(r["arrived"] for r in late) - origin, 1),
            round(max(r["arrived"] for r in late) - origin, 1),
        ]
        if late
        else None,
        "first_chunks": first_chunks(records, origin, window_s),
        "last_chunks": last_chunks(streams, steps),
        "by_index": by_index,
        "frame_period_ms_by_window": {
            f"{k * window_s:g}s": round(statistics.median(v))
            for k, v in sorted(periods.items())
            if len(v) > 5
        },
        "steps_by_window": step_windows(steps, origin, window_s) if steps else None,
        "lanes_by_window": lane_windows(records, origin, window_s),
        "lane_gaps": lane_gaps(records),
    }
