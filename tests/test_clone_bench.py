"""The voice-cloning benchmark runs end to end on CPU against real tritonservers (tiny random
checkpoints: noise, not speech), and serving_bench's voice mix sends its share to registered voices."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from voxtriton.bench.workload import VoiceMix

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    "preset",
    "inline x-vector",
    "inline in-context",
    "inline in-context, repeated",
    "registered x-vector",
    "registered in-context",
]


def run(script: str, *arguments: str) -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *arguments],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]


@pytest.mark.server
def test_clone_bench_smoke_then_a_voice_mix_over_its_voices(tmp_path, tiny_base_checkpoint, tiny_checkpoint):
    out = tmp_path / "clone"
    run(
        "clone_bench.py",
        "--smoke",
        "--checkpoint",
        str(tiny_base_checkpoint),
        "--preset-checkpoint",
        str(tiny_checkpoint),
        "--trace",
        "--out",
        str(out),
    )
    report = json.loads((out / "clone_bench.json").read_text())
    assert report["meta"]["commit"] and report["meta"]["hardware"].startswith("CPU")
    assert [(row["seconds"], row["batch"]) for row in report["encoding"]] == [
        (1.5, 1),
        (1.5, 2),
        (3, 1),
        (3, 2),
    ]
    for row in report["encoding"]:
        costs = ["read_ms", "encode_ms"] + [
            f"{name}_encoder{way}_ms" for name in ("speaker", "speech") for way in ("_eager", "")
        ]
        assert all(row[cost] > 0 for cost in costs)
        expected = row["encode_ms"] / (row["seconds"] * row["batch"])
        assert row["ms_per_reference_second"] == pytest.approx(expected, abs=2e-3)
    assert [row["case"] for row in report["ttfa"]] == CASES
    for row in report["ttfa"]:
        assert row["requests"] == 2 and 0 < row["ttfa_p50_ms"] <= row["ttfa_p90_ms"] < 30000
        assert row["first_warm_up_ms"] > 0 and row["p50_over_preset_ms"] is not None
    # One warm-up and two measured requests per case: a new inline in-context reference primes the
    # codec at each request; the registered voice was primed before the server was ready, and the
    # repeated inline reference is its recording (the same codes, encoded on the same CPU): neither
    # ever primes.
    assert report["codec_primings"] == {"decoded": 3, "reused": 6}
    assert "| registered in-context | 2 |" in (out / "clone_bench.md").read_text()
    # --trace: each case's TTFA split by the servers' traces; a new inline reference waits for its
    # encoding, which no other case does, and no part takes longer than the whole. The
    # way back may be a little below 0: the client can have the chunk before the server's send returns.
    for row in report["ttfa"]:
        parts = row["parts_ms"]
        in_context = row["case"] in (
            "inline in-context",
            "inline in-context, repeated",
            "registered in-context",
        )
        assert ("priming" in parts) == in_context, row
        assert 0 < parts.pop("first_step") <= parts["generate"], row
        parts.pop("priming", None)
        assert set(parts) == {
            "way_in",
            "submit",
            "generate",
            "lane_wait",
            "codec",
            "send",
            "total",
            "way_back",
        }
        assert all(0 <= parts[name] <= row["ttfa_p90_ms"] for name in parts if name != "way_back"), row
    submit = {row["case"]: row["parts_ms"]["submit"] for row in report["ttfa"]}
    unencoded = max(submit[case] for case in ("preset", "registered x-vector", "registered in-context"))
    assert min(submit["inline x-vector"], submit["inline in-context"]) > unencoded, submit
    assert "| case | way_in | submit |" in (out / "clone_bench.md").read_text()

    mixed = tmp_path / "mix"
    run(
        "serving_bench.py",
        "--smoke",
        "--checkpoint",
        str(tiny_base_checkpoint),
        "--param",
        f"tts:voices_dir={out / 'voices'}",
        "--voice",
        "bench-xvector",
        "--voice-mix",
        "bench-in-context:0.5",
        "--out",
        str(mixed),
    )
    results = json.loads((mixed / "results.json").read_text())
    assert results["meta"]["voice_mix"] == "bench-in-context:0.5"
    [row] = results["policies"][0]["rates"]
    assert row["requests"] >= 2 and row["failed"] == 0 and row["completed"] == row["requests"]
    # The in-context voice's share of the probe: primed once at most (if no request before the probe
    # had it), reused after that; the x-vector voice's requests (the rest) prime nothing.
    primings = row["server"]["codec_primings"]
    assert primings["decoded"] <= 1 and primings["reused"] >= 1
    assert primings["decoded"] + primings["reused"] < row["requests"]  # both voices were drawn
    assert "Voices: `bench-in-context:0.5`" in (mixed / "results.md").read_text()


def test_a_voice_mix_draws_each_voice_at_its_share():
    mix = VoiceMix.parse("ryan", "anna:0.3,bob:0.2")
    assert mix.shares == (("anna", 0.3), ("bob", 0.2))
    rng = random.Random(0)
    picks = [mix.pick(rng) for _ in range(20000)]
    for voice, share in (("anna", 0.3), ("bob", 0.2), ("ryan", 0.5)):
        assert picks.count(voice) / len(picks) == pytest.approx(share, abs=0.015)


@pytest.mark.parametrize(
    "text,message",
    [
        ("anna", "'anna' is not VOICE:SHARE"),
        ("anna:half", "'anna:half' is not VOICE:SHARE"),
        ("anna:0", "'anna:0' is not VOICE:SHARE"),
        (":0.5", "':0.5' is not VOICE:SHARE"),
        ("anna:0.6,bob:0.5", "add up to more than 1"),
    ],
)
def test_a_bad_voice_mix_is_refused_saying_why(text, message):
    with pytest.raises(ValueError, match=message):
        VoiceMix.parse(None, text)
