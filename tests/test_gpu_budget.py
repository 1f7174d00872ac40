"""gpu_budget's arithmetic (GPU seconds per second a probe needs from the measured component speeds) and
frame_flops' operation counts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from voxtriton.bench import flops as frame_flops
from voxtriton.bench import gpu_budget
from voxtriton.models.config import load_config

ROOT = Path(__file__).resolve().parents[1]

# Frame steps of 10 ms at batch 100 and 16 ms at batch 200; codec calls of 5 ms for 10 chunks of 25
# frames (20 s of audio: 0.25 ms per audio second) and 1 ms for one chunk of 2 frames (6.25).
MODEL_SPEED = {
    "meta": {"preset": "1.7b"},
    "rows": [{"batch": 100, "frame_step_ms": 10.0}, {"batch": 200, "frame_step_ms": 16.0}],
}
CODEC_SPEED = {"ms": {"1x2": 1.0, "10x25": 5.0}}


def test_interpolation_between_and_beyond_the_measured_batches():
    points = [(100, 10.0), (200, 16.0), (400, 30.0)]
    assert gpu_budget.interpolate(points, 150) == pytest.approx(13.0)
    assert gpu_budget.interpolate(points, 50) == pytest.approx(7.0)  # along the first segment
    assert gpu_budget.interpolate(points, 500) == pytest.approx(37.0)  # along the last
    assert gpu_budget.interpolate([(8, 3.0)], 100) == 3.0


def test_component_costs_per_second_of_audio():
    # 13 ms per step at batch 150: 150 frames of 0.08 s, 12 s of audio.
    assert gpu_budget.backbone_ms_per_audio_s(MODEL_SPEED, 150) == pytest.approx(13.0 / 12.0)
    assert gpu_budget.codec_ms_per_audio_s(CODEC_SPEED) == pytest.approx({"1x2": 6.25, "10x25": 0.25})


def test_ceilings_for_any_policy_at_each_measured_batch():
    """10 s requests are 125 frames. At batch 100, 10 ms steps make 10,000 frames/s (80 req/s); with
    the codec's 0.25 ms per audio second after them, 1.25 + 0.25 ms per audio second (66.7 req/s)."""
    rows = gpu_budget.ceilings(MODEL_SPEED, 0.25, 10.0)
    assert [row["batch"] for row in rows] == [100, 200]
    assert rows[0]["backbone_alone"] == pytest.approx(80.0)
    assert rows[0]["backbone_then_codec"] == pytest.approx(1e3 / 15.0)
    assert rows[1]["backbone_alone"] == pytest.approx(100.0)  # 16 ms for 200 frames: 1.0 ms per audio second
    assert rows[1]["backbone_then_codec"] == pytest.approx(80.0)


def test_the_command_line_budgets_each_probe_of_the_preset(tmp_path):
    """50 req/s of 10 s requests ask for 500 s of audio a second; at 13/12 + 0.25 ms per audio second
    that is 2/3 of the GPU, which 75 req/s would fill. A probe of another preset is left out."""
    for name, checkpoint in (("run", "/tmp/ck-1.7b"), ("other", "/tmp/ck-0.6b")):
        trial = {
            "rate": 50.0,
            "failed": 0,
            "stalled_requests": 0,
            "requests": 100,
            "completed": 100,
            "audio_s": 1000.0,
            "ttfa_p90_ms": 150.0,
            "stall_total_s": 0.0,
            "listeners_peak": 500,
            "server": {"frame_step_ms_mean": 14.0, "frame_step_batch_mean": 150.0},
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(
            json.dumps(
                {
                    "meta": {"command": "serving_bench.py", "checkpoint": checkpoint},
                    "policies": [{"policy": "voxserve", "rates": [trial]}],
                }
            )
        )
    (tmp_path / "model.json").write_text(json.dumps(MODEL_SPEED))
    (tmp_path / "codec.json").write_text(json.dumps(CODEC_SPEED))
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_budget.py"),
            "--model-speed",
            str(tmp_path / "model.json"),
            "--codec-speed",
            str(tmp_path / "codec.json"),
            str(tmp_path / "run"),
            str(tmp_path / "other"),
            "--baseline-goodput",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| 1.7b")]
    assert rows == ["| 1.7b | voxserve | run | 50 | yes | 10.00 | 500 | 150 | 1.083 | 0.250 | 0.67 | 75 |"]
    assert "0.6b" not in completed.stdout and "the budget uses the best, 10x25" in completed.stdout
    assert "| 100 | 10.00 | 80 (2.00x) | 67 (1.67x) |" in completed.stdout.splitlines()
    assert "| 200 | 16.00 | 100 (2.50x) | 80 (2.00x) |" in completed.stdout.splitlines()


def frame_step_flops(talker, span: int) -> int:
    """The frame step's operations worked out by hand from the shapes: every linear layer's weights
    once per token (2 operations per multiply-add), attention over `span` positions (QK and AV).

    The talker takes one token; the projection of text embeddings adds a two-layer MLP and the codec
    head a matrix. The code predictor runs 16 tokens (the talker's state and codebook 0 together,
    then codebooks 1..14 one by one), each through its input projection, over its 16-position cache,
    and 15 heads."""

    def linear(t):
        return t.num_layers * (
            2 * t.hidden_size * t.num_heads * t.head_dim
            + 2 * t.hidden_size * t.num_kv_heads * t.head_dim
            + 3 * t.hidden_size * t.intermediate_size
        )

    def attention(t, queries, positions):
        return t.num_layers * 2 * 2 * t.num_heads * t.head_dim * positions * queries

    main, small = talker.transformer, talker.predictor
    flops = 2 * linear(main) + attention(main, 1, span) + 2 * main.hidden_size * talker.vocab_size
    flops += 2 * (talker.text_hidden_size**2 + talker.text_hidden_size * main.hidden_size)
    projection = 2 * main.hidden_size * small.hidden_size if small.hidden_size != main.hidden_size else 0
    flops += 16 * (2 * linear(small) + projection) + attention(small, 16, 16)
    return flops + 15 * 2 * small.hidden_size * talker.predictor_vocab_size


@pytest.mark.parametrize("preset", ["1.7b", "0.6b"])
def test_the_frame_step_counts_what_its_shapes_say(tmp_path, preset):
    """FlopCounterMode over ModelRunner.decode on the meta device agrees with the count by hand; the
    1.7B step is about 5.6 GFLOP per frame at span 512."""
    presets = ROOT / "voxtriton" / "models" / "presets"
    shutil.copy(presets / preset / "config.json", tmp_path / "config.json")
    shutil.copy(presets / "common" / "generation_config.json", tmp_path / "generation_config.json")
    shutil.copytree(presets / "common" / "speech_tokenizer", tmp_path / "speech_tokenizer")
    config = load_config(tmp_path)
    for batch, span in ((1, 128), (4, 512)):
        assert frame_flops.backbone_flops_per_frame(config, batch, span) == frame_step_flops(
            config.talker, span
        )
    if preset == "1.7b":
        assert frame_step_flops(config.talker, 512) == pytest.approx(5.62e9, rel=1e-3)


def test_codec_operations_per_frame_do_not_depend_on_the_batch(tiny_checkpoint):
    config = load_config(tiny_checkpoint)
    one, four = (frame_flops.codec_flops_per_frame(config, batch, 8) for batch in (1, 4))
    assert one > 0 and one == pytest.approx(four, rel=1e-9)
