"""benchmarks/chunk_trace_report.py on a hand-made trace whose answers are known."""

from __future__ import annotations

import gzip
import json

from voxtriton.bench.chunk_trace import read_trace, report


def stream(name, arrived, period, late_index=None):
    """Chunks of 2,2,4,4,8 frames cut as their frames arrive every `period` s, each decoded in 5 ms
    after a 1 ms wait; chunk `late_index` is sent after it was due."""
    records, frames, first_sent, played = [], 0, None, 0.0
    for index, size in enumerate((2, 2, 4, 4, 8)):
        frames += size
        cut = arrived + 0.05 + frames * period
        sent = cut + 0.006
        first_sent = first_sent if first_sent is not None else sent
        due = arrived + 0.2 if index == 0 else first_sent + played
        if index == late_index:
            due = sent - 0.01
        records.append(
            {
                "stream": name,
                "index": index,
                "lane": "urgent",
                "promoted": False,
                "frames": size,
                "batch": 1,
                "arrived": arrived,
                "cut": cut,
                "start": cut + 0.001,
                "end": sent,
                "due": due,
                "sent": sent,
            }
        )
        played += size * 0.08
    return records


def test_the_report_finds_late_chunks_cut_times_and_the_frame_period(tmp_path):
    records = [r for i in range(9) for r in stream(f"a{i}", 0.1 * i, 0.02)]  # the median stream
    records += [
        r for i in range(7) for r in stream(f"b{i}", 5.0 + 0.1 * i, 0.05, late_index=2 if i == 0 else None)
    ]
    records[47]["promoted"] = True  # b0's late chunk 2 waited for the background lane first
    records[48]["taken"] = True  # and its chunk 3 was taken from there by the idle urgent lane
    for record in records[:5]:
        record["lane"] = "background"
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    result = report(read_trace(path), window_s=4.0)
    assert result["chunks"] == 80 and result["late"] == 1
    assert result["late_by_index"] == {2: 1} and result["late_by_lane"] == {"urgent": 1}
    assert result["chunks_by_route"] == {
        "background": 5,
        "urgent": 73,
        "urgent/promoted": 1,
        "urgent/taken": 1,
    }
    assert result["late_by_route"] == {"urgent/promoted": 1}
    assert result["late_arrived_s"] == [5.0, 5.0]
    # Chunk 2 ends at frame 8, cut 6 frame steps after the first chunk (sent 6 ms after its cut).
    assert result["by_index"][2]["cut_after_first_sent_ms_p50"] == round((6 * 0.02 - 0.006) * 1e3)
    assert result["by_index"][2]["cut_after_first_sent_ms_p99"] == round((6 * 0.05 - 0.006) * 1e3)
    assert result["by_index"][1]["lane_wait_ms_p50"] == 1
    assert result["frame_period_ms_by_window"] == {"0s": 20, "4s": 50}


def test_chunks_of_one_call_count_once_per_lane_window(tmp_path):
    call = {
        "stream": "s",
        "index": 1,
        "lane": "background",
        "promoted": False,
        "frames": 8,
        "batch": 3,
        "arrived": 0.0,
        "cut": 0.5,
        "start": 1.0,
        "end": 1.4,
        "due": 9.0,
        "sent": 1.4,
    }
    records = stream("a", 0.0, 0.02) + [{**call, "stream": name} for name in "xyz"]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lanes = report(read_trace(path), window_s=2.0)["lanes_by_window"]["0s"]
    assert lanes["background"] == {"calls": 1, "chunks_per_call": 3.0, "busy": 0.2}
    assert lanes["urgent"]["calls"] == 5


def test_step_lines_are_split_into_windows_and_parts(tmp_path):
    records = stream("a", 0.0, 0.02)
    steps = [
        {
            "kind": "step",
            "end": 0.5 + 0.1 * i,
            "period": 0.030,
            "frames": 100 + i,
            "admit_s": 0.004,
            "decode_s": 0.020,
            "decode_device_s": 0.018,
            "prefill_device_s": 0.003 if i % 2 else None,
            "admitted": i % 2,
            "batch": 100 + i,
        }
        for i in range(4)
    ]
    steps.append({**steps[0], "end": 4.5, "period": 0.050, "frames": 0})  # a launch that returned nothing
    steps.append(
        {
            **steps[0],
            "end": 4.6,
            "period": 0.050,
            "decode_s": 0.040,
            "decode_device_s": None,
            "prefill_device_s": None,
        }
    )  # on a CPU
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records + steps))
    result = report(read_trace(path), window_s=4.0)
    assert result["chunks"] == 5
    assert result["steps_by_window"] == {
        "0s": {
            "steps": 4,
            "period_ms_p50": 30.0,
            "frames_p50": 101.5,
            "admit_ms": 4.0,
            "decode_ms": 20.0,
            "other_ms": 6.0,
            "device_ms": 18.0,
            "prefill_device_ms": 1.5,
            "admitted": 2,
        },
        "4s": {
            "steps": 1,
            "period_ms_p50": 50.0,
            "frames_p50": 100,
            "admit_ms": 4.0,
            "decode_ms": 40.0,
            "other_ms": 6.0,
            "device_ms": None,
            "prefill_device_ms": None,
            "admitted": 0,
        },
    }


def test_gaps_between_calls_are_split_by_whether_a_chunk_was_waiting(tmp_path):
    """Calls on one lane: the second's chunk was cut while the first ran (a 4 ms gap of host work),
    the third's only after the second ended (a 100 ms idle gap); a fourth lies within the third."""

    def chunk(name, cut, start, end, sent):
        return {
            "stream": name,
            "index": 1,
            "lane": "urgent",
            "promoted": False,
            "frames": 2,
            "batch": 1,
            "arrived": 0.0,
            "cut": cut,
            "start": start,
            "end": end,
            "due": 9.0,
            "sent": sent,
        }

    records = [
        chunk("a", 0.000, 0.001, 0.010, 0.012),
        chunk("b", 0.005, 0.014, 0.020, 0.021),
        chunk("c", 0.050, 0.120, 0.130, 0.133),
        chunk("d", 0.110, 0.125, 0.128, 0.129),
    ]  # within call c: no gap of its own
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    gaps = report(read_trace(path))["lane_gaps"]["urgent"]
    assert gaps["calls"] == 4 and gaps["call_ms_p50"] == 9.0
    assert (gaps["gaps_with_work_waiting"], gaps["work_gap_ms_p50"], gaps["work_gaps_s"]) == (1, 4.0, 0.0)
    assert (gaps["idle_gaps"], gaps["idle_gaps_s"]) == (1, 0.1)
    assert gaps["send_after_call_ms_p50"] == 2.0
    # At call b's start chunk d was not cut yet; at c's, d (cut at 0.110, started at 0.125) waited.
    assert (gaps["waiting_at_call_start_p50"], gaps["waiting_at_call_start_p90"]) == (0, 1)
    assert gaps["waiting_frames_mix"] == {2: 1} and gaps["chunks_per_call_p50"] == 1


def test_first_chunks_split_the_servers_ttfa_and_find_the_tail(tmp_path):
    """Nine first chunks wait 1 ms for their lane; a tenth, later, waits 300 ms: the slowest tenth is
    that one, and its window shows it."""
    records = [r for i in range(9) for r in stream(f"a{i}", 0.1 * i, 0.02)]
    slow = stream("slow", 5.0, 0.02)
    slow[0] = {
        **slow[0],
        "start": slow[0]["cut"] + 0.3,
        "end": slow[0]["cut"] + 0.305,
        "sent": slow[0]["cut"] + 0.307,
    }
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records + slow))
    firsts = report(read_trace(path), window_s=4.0)["first_chunks"]
    assert firsts["count"] == 10
    # stream(): cut 50 ms + 2 frames of 20 ms after arrival, a 1 ms wait, 5 ms codec, sent as it ends
    assert firsts["p50_ms"] == {
        "submit": 0.0,
        "generate": 90.0,
        "lane_wait": 1.0,
        "codec": 5.0,
        "send": 0.0,
        "total": 96.0,
    }
    assert firsts["slowest_tenth_mean_ms"] == {
        "submit": 0.0,
        "generate": 90.0,
        "lane_wait": 300.0,
        "codec": 5.0,
        "send": 2.0,
        "total": 397.0,
    }
    assert (
        firsts["p90_ms_by_window"]["0s"]["total"] == 96.0 and firsts["p90_ms_by_window"]["0s"]["count"] == 9
    )
    assert firsts["p90_ms_by_window"]["4s"] == {
        "count": 1,
        "submit": 0.0,
        "generate": 90.0,
        "lane_wait": 300.0,
        "codec": 5.0,
        "send": 2.0,
        "total": 397.0,
    }
    assert firsts["primed_after_cut_ms"] is None  # no in-context voice


def test_the_wait_before_submit_and_the_priming_are_split_out_of_the_first_chunks_path(tmp_path):
    """A request whose reference took 30 ms to encode before the service took it, and whose priming
    ended 4 ms after its first chunk's frames were cut; a preset-voice request beside it."""
    cloned = stream("cloned", 0.0, 0.02)
    first = cloned[0]  # generation starts once the voice is there: 30 ms later than stream()'s
    cloned[0] = {**first, **{key: first[key] + 0.03 for key in ("cut", "start", "end", "sent")}}
    cloned[0].update(submitted=0.03, primed=cloned[0]["cut"] + 0.004)
    preset = stream("preset", 0.0, 0.02)
    preset[0] = {**preset[0], "submitted": 0.0, "primed": None}
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in cloned + preset))
    firsts = report(read_trace(path), window_s=4.0)["first_chunks"]
    assert firsts["slowest_tenth_mean_ms"] == {
        "submit": 30.0,
        "generate": 90.0,
        "lane_wait": 1.0,
        "codec": 5.0,
        "send": 0.0,
        "total": 126.0,
    }
    assert firsts["primed_after_cut_ms"] == {"count": 1, "p50": 4.0, "p90": 4.0}


def test_last_chunks_split_an_input_streams_last_word_to_its_last_audio(tmp_path):
    """Input stream a: its text ends at 0.30 s; frame steps every 20 ms end its last chunk's frames at
    0.41 s (6 steps after the text), the chunk waits 2 ms, decodes in 5 and is sent 1 ms later. Input
    streams b and b2's last chunks are cut when their predecessor is sent, 3 steps after their text
    ended, after their frames. A plain
    stream has no last word and is left out."""
    a = stream("a", 0.0, 0.02)
    a[-1] = {**a[-1], "cut": 0.41, "start": 0.412, "end": 0.417, "sent": 0.418}
    b = stream("b", 0.0, 0.02)
    b[-1] = {**b[-1], "cut": b[-2]["sent"], "start": b[-2]["sent"] + 0.001}
    b[-1]["end"] = b[-1]["sent"] = b[-1]["start"] + 0.005
    b2 = [{**r, "stream": "b2"} for r in b]
    for records, ended in ((a, 0.30), (b, b[-2]["sent"] - 0.05), (b2, b[-2]["sent"] - 0.05)):
        for record in records:
            record["text_ended"] = ended
    step = {"kind": "step", "period": 0.02, "frames": 2, "admit_s": 0.0, "decode_s": 0.015}
    step.update(decode_device_s=None, prefill_device_s=None, admitted=0, batch=2)
    steps = [{**step, "end": 0.25 + 0.02 * i} for i in range(9)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in a + b + b2 + stream("c", 0.0, 0.02) + steps))
    last = report(read_trace(path))["last_chunks"]
    assert last["count"] == 3 and last["cut_at_previous_chunk"] == 2
    assert last["p50_ms"] == {"generate": 50.0, "lane_wait": 1.0, "codec": 5.0, "send": 0.0, "total": 56.0}
    assert last["p90_ms"] == {"generate": 110.0, "lane_wait": 2.0, "codec": 5.0, "send": 1.0, "total": 118.0}
    assert last["steps_after_text_p50"] == 3 and last["step_period_ms_p50"] == 20.0
    assert last["frames_p50"] == 8
