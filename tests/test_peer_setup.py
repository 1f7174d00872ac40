"""The vLLM-Omni peer scripts (benchmarks/peers/vllm_omni), as far as they run without a GPU: the
deploy-config rewrite, the shell scripts' syntax, and bench.sh's serving_bench command line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from voxtriton.serving.launcher import free_port

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "vllm_omni"


def tune_deploy():
    spec = importlib.util.spec_from_file_location("tune_deploy", PEER / "tune_deploy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shipped_shape() -> dict:
    """The layout of vLLM-Omni's deploy/qwen3_tts.yaml: a connector's extra settings, two stages."""
    extra = {"codec_chunk_frames": 25, "codec_left_context_frames": 72, "initial_codec_chunk_frames": 1}
    return {
        "async_chunk": True,
        "connectors": {"connector_of_shared_memory": {"name": "SharedMemoryConnector", "extra": extra}},
        "stages": [
            {"stage_id": 0, "max_num_seqs": 64, "gpu_memory_utilization": 0.3, "devices": "0"},
            {"stage_id": 1, "max_num_seqs": 64, "gpu_memory_utilization": 0.3, "enforce_eager": False},
        ],
    }


def test_the_deploy_config_gets_every_setting_where_it_lives():
    settings = {
        "initial_codec_chunk_frames": 8,
        "max_num_seqs": 256,
        "gpu_memory_utilization": 0.45,
        "enforce_eager": False,
    }
    config, found = tune_deploy().tuned(shipped_shape(), settings, [4, 4, 8, 16, 25])
    extra = config["connectors"]["connector_of_shared_memory"]["extra"]
    assert extra["initial_codec_chunk_frames"] == 8 and extra["codec_chunk_ramp"] == [4, 4, 8, 16, 25]
    assert extra["codec_chunk_frames"] == 25 and extra["codec_left_context_frames"] == 72
    assert [(s["max_num_seqs"], s["gpu_memory_utilization"]) for s in config["stages"]] == [(256, 0.45)] * 2
    assert found == {
        "initial_codec_chunk_frames": 1,
        "max_num_seqs": 2,
        "gpu_memory_utilization": 2,
        "enforce_eager": 1,
        "codec_chunk_ramp": 1,
    }
    # No ramp asked: none added. A key the file lacks is counted as found nowhere.
    config, found = tune_deploy().tuned(shipped_shape(), {"max_num_batched": 1}, None)
    assert "codec_chunk_ramp" not in config["connectors"]["connector_of_shared_memory"]["extra"]
    assert found == {"max_num_batched": 0}


def test_replicas_copy_both_stages_onto_each_gpu():
    """--replicas 4: every stage runs 4 copies from its template on GPU 0 (devices "0", also where the
    file leaves it out), which vLLM-Omni offsets to GPUs 0-3. A stage elsewhere or over several GPUs
    is no such template (vLLM-Omni refuses offsets past its tensor-parallel size), and the error
    names it; so is a count below 1."""
    config = tune_deploy().replicated(shipped_shape(), 4)
    assert [(s["devices"], s["num_replicas"]) for s in config["stages"]] == [("0", 4), ("0", 4)]
    for devices, tensor_parallel in (("0,1", 1), ("1", 1), ("0", 2)):
        placed = shipped_shape()
        placed["stages"][1].update(devices=devices, tensor_parallel_size=tensor_parallel)
        message = f"stage 1: devices '{devices}', tensor_parallel_size {tensor_parallel}; --replicas copies"
        with pytest.raises(ValueError, match=message):
            tune_deploy().replicated(placed, 2)
    with pytest.raises(ValueError, match="--replicas must be at least 1, got 0"):
        tune_deploy().replicated(shipped_shape(), 0)


@pytest.mark.parametrize("script", ["install.sh", "serve.sh", "bench.sh", "../compare.sh"])
def test_the_scripts_parse(script):
    completed = subprocess.run(["bash", "-n", str(PEER / script)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize("gpus, label", [("1", "vllm-omni-i8"), ("2", "vllm-omni-i8 on 2 GPUs")])
def test_bench_sh_gives_serving_bench_a_command_line_it_accepts(tmp_path, gpus, label):
    """Against a port where nothing listens: serving_bench takes every argument bench.sh builds (the
    extra body's JSON included; a server on several GPUs named so) and stops at its test request,
    measuring nothing."""
    port = free_port()
    env = {
        **os.environ,
        "PY": sys.executable,
        "PORT": str(port),
        "OUT": str(tmp_path),
        "W": "0",
        "GPUS": gpus,
    }
    completed = subprocess.run(
        ["bash", str(PEER / "bench.sh"), str(tmp_path), "rates", "2,3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert f"{label} at http://127.0.0.1:{port} did not serve a test request" in completed.stderr
    assert not list(tmp_path.glob("*/results.json"))
