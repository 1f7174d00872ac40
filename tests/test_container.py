"""The image's entrypoint (voxtriton.container): command, checkpoint and arguments, decided on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from voxtriton.cli import build_parser
from voxtriton.container import REPOSITORY, EntrypointError, plan

NOISE = "serving the built-in random-weight checkpoint (noise)"


def parsed(argv: list[str]):
    """The arguments the real `voxtriton` command line makes of a plan: every flag must exist."""
    assert argv[0] == "voxtriton"
    return build_parser().parse_args(argv[1:])


def run_entrypoint(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "voxtriton.container", *args],
        env={"PATH": str(Path(sys.executable).parent), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_empty_mount_serves_the_random_checkpoint_and_says_so(tmp_path):
    mount = tmp_path / "checkpoint"
    mount.mkdir()
    (mount / ".keep").touch()  # hidden files do not make a checkpoint
    chosen = plan([], {}, mount=mount)
    args = parsed(chosen.argv)
    assert args.command == "serve" and args.checkpoint is None
    assert chosen.notice.startswith(f"voxtriton: no checkpoint in {mount}; {NOISE}")


def test_a_mount_with_only_an_unfinished_download_is_not_taken_for_empty(tmp_path):
    """`hf download --local-dir` writes its state in .cache/huggingface first: not an empty mount
    to serve noise from, but a download to finish."""
    mount = tmp_path / "checkpoint"
    (mount / ".cache" / "huggingface" / "download").mkdir(parents=True)
    with pytest.raises(EntrypointError, match="holds only an unfinished Hugging Face download"):
        plan([], {}, mount=mount)


def test_missing_mount_serves_the_random_checkpoint_and_says_so(tmp_path):
    mount = tmp_path / "absent"
    chosen = plan(["serve"], {}, mount=mount)
    assert parsed(chosen.argv).checkpoint is None
    assert f"no checkpoint in {mount}; {NOISE}" in chosen.notice


def test_valid_checkpoint_is_served_from_the_mount_or_the_environment(tiny_checkpoint, tmp_path):
    from_mount = plan([], {}, mount=tiny_checkpoint)
    from_env = plan([], {"VOXTRITON_CHECKPOINT": str(tiny_checkpoint)}, mount=tmp_path / "absent")
    for chosen in (from_mount, from_env):
        args = parsed(chosen.argv)
        assert args.checkpoint == str(tiny_checkpoint) and chosen.notice is None
        assert args.host == "0.0.0.0" and args.model_repository == REPOSITORY


def test_files_that_are_not_a_checkpoint_fail_with_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(EntrypointError) as missing:
        plan([], {}, mount=tmp_path)
    assert str(missing.value) == (
        f"{tmp_path} holds files but is not a usable checkpoint: {tmp_path / 'config.json'}: file is missing"
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(EntrypointError, match=r"config\.json: model_type = 'llama' is not supported"):
        plan([], {"VOXTRITON_CHECKPOINT": str(tmp_path)})


def test_a_named_checkpoint_that_is_not_there_is_an_error(tmp_path):
    with pytest.raises(EntrypointError, match=r"^VOXTRITON_CHECKPOINT=\S+/gone: no such directory$"):
        plan([], {"VOXTRITON_CHECKPOINT": str(tmp_path / "gone")})
    (tmp_path / "file").touch()
    with pytest.raises(EntrypointError, match=r"file: is a file, not a checkpoint directory$"):
        plan([], {}, mount=tmp_path / "file")


def test_gateway_mode_listens_on_all_interfaces():
    chosen = plan(["gateway", "--backend", "triton:8001", "--port", "8080"], {})
    args = parsed(chosen.argv)
    assert args.command == "gateway" and args.host == "0.0.0.0" and chosen.notice is None
    assert args.backend == ["triton:8001"] and args.port == 8080


def test_extra_arguments_pass_through_and_win(tmp_path):
    mount = tmp_path / "absent"
    serve = parsed(plan(["serve", "--param", "tts:max_streams=8", "--grpc-port", "9001"], {}, mount).argv)
    assert serve.param == ["tts:max_streams=8"] and serve.grpc_port == 9001
    # options alone mean serve; later flags override the entrypoint's defaults
    options = parsed(plan(["--host", "127.0.0.1", "--policy", "serial"], {}, mount).argv)
    assert options.command == "serve" and options.host == "127.0.0.1" and options.policy == "serial"


def test_an_explicit_checkpoint_argument_skips_the_mount(tmp_path):
    (tmp_path / "junk").touch()  # the mount would fail, but the user named another checkpoint
    chosen = plan(["serve", "--checkpoint", "/data/ck"], {}, mount=tmp_path)
    assert parsed(chosen.argv).checkpoint == "/data/ck" and chosen.argv.count("--checkpoint") == 1
    chosen = plan(["--checkpoint=/data/ck"], {}, mount=tmp_path)
    assert parsed(chosen.argv).checkpoint == "/data/ck"


def test_any_other_command_runs_as_given():
    assert plan(["bash", "-c", "nvidia-smi"], {"VOXTRITON_CHECKPOINT": "/nowhere"}).argv == [
        "bash",
        "-c",
        "nvidia-smi",
    ]


def test_the_module_execs_the_command_or_fails_in_one_line(tmp_path):
    ran = run_entrypoint(sys.executable, "-c", "print('exec ok')", env={})
    assert ran.returncode == 0 and ran.stdout == "exec ok\n"
    (tmp_path / "weights.bin").touch()
    bad = run_entrypoint("serve", env={"VOXTRITON_CHECKPOINT": str(tmp_path)})
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        f"voxtriton: {tmp_path} holds files but is not a usable checkpoint: "
        f"{tmp_path / 'config.json'}: file is missing"
    ]
    missing = run_entrypoint("no-such-command", env={})
    assert missing.returncode == 127
    assert missing.stderr.splitlines() == ["voxtriton: cannot run no-such-command: No such file or directory"]
