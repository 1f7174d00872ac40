"""`voxtriton serve` refuses a bad command before it starts Triton: one line on stderr naming the
problem, a non-zero exit, and quickly (the time bound only catches a Triton start, which takes tens of
seconds; it is not a speed target)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from voxtriton.launch.server import free_port, free_ports

QUICK_S = 10.0


def serve(*arguments: str, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    """`voxtriton serve` on free ports unless `arguments` name them; (result, seconds)."""
    ports = dict(zip(("--grpc-port", "--http-port", "--metrics-port"), free_ports(3)))
    command = [sys.executable, "-m", "voxtriton.cli", "serve", *arguments]
    for option, port in ports.items():
        if option not in arguments:
            command += [option, str(port)]
    began = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)
    return result, time.monotonic() - began


def assert_refused(result: subprocess.CompletedProcess, seconds: float, *named: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode != 0, result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("voxtriton: "), result.stderr
    for text in named:
        assert text in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert seconds < QUICK_S, f"took {seconds:.1f} s: did it start Triton?"


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    """A copy of the tiny random-weight checkpoint that a test may break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint")


def test_a_missing_checkpoint_directory_is_named(tmp_path):
    result, seconds = serve("--checkpoint", str(tmp_path / "nowhere"))
    assert_refused(result, seconds, "--checkpoint", "nowhere", "no such directory")


def test_a_checkpoint_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result, seconds = serve("--checkpoint", str(tmp_path / "model.safetensors"))
    assert_refused(result, seconds, "--checkpoint", "not a directory")


@pytest.mark.parametrize(
    "missing, named",
    [
        ("config.json", "config.json is missing"),
        ("model.safetensors", "model.safetensors or model.safetensors.index.json is missing"),
        ("speech_tokenizer/config.json", "speech_tokenizer/config.json is missing"),
        ("speech_tokenizer/model.safetensors", "speech_tokenizer/model.safetensors or"),
        ("speech_tokenizer", "speech_tokenizer/config.json is missing"),
    ],
)
def test_a_missing_checkpoint_file_is_named(checkpoint, missing, named):
    path = checkpoint / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    result, seconds = serve("--checkpoint", str(checkpoint))
    assert_refused(result, seconds, "--checkpoint", named)


def test_a_sharded_checkpoint_passes_the_file_checks(tmp_path):
    """model.safetensors.index.json stands for model.safetensors: the checks pass it and go on to the
    next problem, here a port."""
    from voxtriton.models.random_checkpoint import make_checkpoint

    sharded = make_checkpoint("tiny", tmp_path / "sharded", seed=0, shard_mb=1, tokenizer=False)
    assert not (sharded / "model.safetensors").exists()
    result, seconds = serve("--checkpoint", str(sharded), "--grpc-port", "70000")
    assert_refused(result, seconds, "--grpc-port 70000", "not a port number")


def test_weights_left_as_git_lfs_pointers_are_named(checkpoint):
    """A clone without `git lfs pull` has a small text file in place of each weights file."""
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 3400000000\n"
    (checkpoint / "speech_tokenizer" / "model.safetensors").write_text(pointer)
    result, seconds = serve("--checkpoint", str(checkpoint))
    assert_refused(result, seconds, "speech_tokenizer/model.safetensors: a Git LFS pointer", "git lfs pull")


def test_a_checkpoint_with_a_bad_config_is_named(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama"}')
    result, seconds = serve("--checkpoint", str(checkpoint))
    assert_refused(result, seconds, "--checkpoint", "config.json", "model_type")


@pytest.mark.parametrize("option", ["--grpc-port", "--http-port", "--metrics-port"])
def test_a_port_in_use_is_named(checkpoint, option):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result, seconds = serve("--checkpoint", str(checkpoint), option, str(port))
    assert_refused(result, seconds, f"{option} {port}", "already in use", f"pass {option} with a free port")


def test_one_port_for_two_services_is_refused(checkpoint):
    port = str(free_port())
    result, seconds = serve("--checkpoint", str(checkpoint), "--grpc-port", port, "--http-port", port)
    assert_refused(result, seconds, f"--http-port {port}", "--grpc-port uses the same port")


def test_a_missing_tritonserver_is_named(checkpoint, tmp_path):
    result, seconds = serve("--checkpoint", str(checkpoint), "--tritonserver", str(tmp_path / "tritonserver"))
    assert_refused(result, seconds, "--tritonserver", "no such file")


def test_a_tritonserver_that_cannot_run_is_named(checkpoint, tmp_path):
    """Not executable: refused before the start. Executable but no program (built for another
    machine, say): the start's error in one line, not a traceback."""
    binary = tmp_path / "tritonserver"
    binary.write_bytes(b"\x00 not a program")
    result, seconds = serve("--checkpoint", str(checkpoint), "--tritonserver", str(binary))
    assert_refused(result, seconds, "--tritonserver", "not executable")
    binary.chmod(0o755)
    result, seconds = serve("--checkpoint", str(checkpoint), "--tritonserver", str(binary))
    assert_refused(result, seconds, f"cannot run {binary}: Exec format error")


@pytest.mark.parametrize(
    "param, named",
    [
        ("tts.max_streams=8", "expected MODEL:KEY=VALUE"),
        ("tts:max_streams", "expected MODEL:KEY=VALUE"),
        (":max_streams=8", "expected MODEL:KEY=VALUE"),
        ("tss:max_streams=8", "unknown model 'tss'"),
        ("tts:max_stream=8", "unknown parameter(s) max_stream (did you mean max_streams?); the keys: docs/"),
        ("*:max_streams=8", "model codec_background: config.pbtxt: unknown parameter(s) max_streams"),
        ("tts:max_streams=many", "'max_streams': cannot read 'many' as int"),
        ("tts: max_stream=8", "unknown parameter(s) max_stream (did you mean max_streams?)"),
        ("tts:cuda_graphs=maybe", "'cuda_graphs': cannot read 'maybe' as bool"),
        ("tts:backbone_partition=half", "'backbone_partition' must be exclusive or shared"),
        ("tts:scheduler_chunk_schedule=0,4", "chunk_schedule must be comma-separated frame counts"),
        ("codec_urgent:sm_count=-3", "model codec_urgent: config.pbtxt parameter 'sm_count'"),
        ('tts:voices_dir=/data/"best"', "voices_dir: '/data/\"best\"' holds a quote or a backslash"),
    ],
)
def test_a_bad_param_is_named(checkpoint, param, named):
    result, seconds = serve("--checkpoint", str(checkpoint), "--param", param)
    assert_refused(result, seconds, named)


def test_the_default_checkpoint_skips_the_checkpoint_checks():
    """Without --checkpoint the embedded default is served: the checks go on to the next problem."""
    result, seconds = serve("--param", "tts:max_streams=many")
    assert_refused(result, seconds, "'max_streams': cannot read 'many' as int")


@pytest.mark.server
def test_a_failed_start_prints_the_log_lines_that_say_why(checkpoint, tmp_path):
    """A checkpoint that passes the checks but cannot be loaded: Triton starts, the tts model fails to
    load; serve prints the log's error lines, not a traceback nor the whole log."""
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    env = {**os.environ, "VOXTRITON_CACHE": str(tmp_path / "cache")}
    ports = [str(port) for port in free_ports(3)]
    result = subprocess.run(
        [sys.executable, "-m", "voxtriton.cli", "serve", "--checkpoint", str(checkpoint)]
        + ["--grpc-port", ports[0], "--http-port", ports[1], "--metrics-port", ports[2]],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert lines[0] == "voxtriton: the tts model did not load; its log says:", result.stderr
    assert 2 <= len(lines) <= 9, result.stderr
    assert any("failed to load 'tts'" in line and "model.safetensors" in line for line in lines), (
        result.stderr
    )
    assert "Traceback" not in result.stdout + result.stderr
