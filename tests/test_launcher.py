"""`voxtriton serve`: renders the repository, binds loopback, and leaves no process behind on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from server_helpers import processes_mentioning, read_until_ready
from voxtriton_client import TTSClient

from voxtriton.launch.gpus import gpu_count
from voxtriton.launch.repository import REPOSITORY, render_repository, set_parameter
from voxtriton.launch.serve import first_request_hint, parse_params
from voxtriton.launch.server import TritonServer, free_ports


def test_set_parameter_replaces_or_appends():
    text = 'name: "x"\nparameters { key: "device" value: { string_value: "auto" } }\n'
    replaced = set_parameter(text, "device", "cuda:1")
    assert 'string_value: "cuda:1"' in replaced and "auto" not in replaced
    appended = set_parameter(text, "sm_count", "20")
    assert appended.endswith('parameters { key: "sm_count" value: { string_value: "20" } }\n')


def test_render_sets_per_model_parameters(tmp_path):
    target = render_repository(
        REPOSITORY,
        tmp_path / "repo",
        {"*": {"checkpoint_dir": "/ckpt"}, "tts": {"scheduler_policy": "serial"}},
    )
    tts = (target / "tts" / "config.pbtxt").read_text()
    codec = (target / "codec_urgent" / "config.pbtxt").read_text()
    assert 'key: "scheduler_policy" value: { string_value: "serial" }' in tts
    assert '"checkpoint_dir" value: { string_value: "/ckpt" }' in tts and '"/ckpt"' in codec
    assert "scheduler_policy" not in codec
    assert (REPOSITORY / "tts" / "config.pbtxt").read_text() != tts  # the source is untouched


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
@pytest.mark.parametrize(
    "visible, gpu, daemon, clients",
    [
        ("1", None, "1", "0"),
        ("2,3", None, "2,3", "0,1"),
        (None, 1, "1", "0"),
        ("2,3", 1, "3", "0"),
        ("GPU-a, GPU-b", None, "GPU-a, GPU-b", "0,1"),
        ("0,-1,1", None, "0,-1,1", "0"),
        (None, None, None, None),
    ],
)
def test_mps_clients_number_the_gpus_their_mps_server_sees(monkeypatch, visible, gpu, daemon, clients):
    """The MPS daemon gets the real devices (a pinned GPU counts among those CUDA_VISIBLE_DEVICES
    allows); the server's processes, its MPS clients, get them renumbered from 0. Without MPS the
    server gets the real devices too."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    server = TritonServer(use_mps=True, gpu=gpu)
    try:
        assert {**os.environ, **server.mps.pinned}.get("CUDA_VISIBLE_DEVICES") == daemon
        server.mps.started = True  # as after `nvidia-cuda-mps-control -d` succeeded (no GPU here)
        assert server.environment().get("CUDA_VISIBLE_DEVICES") == clients
        server.mps.started = False  # MPS unavailable
        assert server.environment().get("CUDA_VISIBLE_DEVICES") == daemon
    finally:
        server.cleanup()


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
def test_a_pinned_gpu_outside_cuda_visible_devices_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(SystemExit, match="GPU 2 is not among the 2 that CUDA_VISIBLE_DEVICES='2,3' allows"):
        TritonServer(use_mps=False, gpu=2)


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
def test_background_partition_is_one_setting():
    """tts:background_sms and codec_background:sm_count size the same SMs: either sets both. A policy
    no server has is refused before anything starts."""
    for given in ({"tts": {"background_sms": "48"}}, {"codec_background": {"sm_count": "48"}}):
        server = TritonServer(policy="voxserve", parameters=given, use_mps=False)
        try:
            tts = (server.repository / "tts" / "config.pbtxt").read_text()
            lane = (server.repository / "codec_background" / "config.pbtxt").read_text()
            assert 'key: "background_sms" value: { string_value: "48" }' in tts
            assert 'key: "sm_count" value: { string_value: "48" }' in lane
        finally:
            server.cleanup()
    workdirs = set(Path(tempfile.gettempdir()).glob("voxtriton-*"))
    with pytest.raises(SystemExit, match="codec_background:sm_count=32 and tts:background_sms=48 must agree"):
        TritonServer(parameters={"tts": {"background_sms": "48"}, "codec_background": {"sm_count": "32"}})
    assert set(Path(tempfile.gettempdir()).glob("voxtriton-*")) <= workdirs  # the refused one's is gone
    # disaggregated: the codec lanes take a second GPU whole; the backbone partition setting stays its own
    server = TritonServer(policy="disaggregated", parameters={"tts": {"background_sms": "48"}}, use_mps=False)
    try:
        lane = (server.repository / "codec_background" / "config.pbtxt").read_text()
        assert 'key: "sm_count" value: { string_value: "48" }' not in lane
    finally:
        server.cleanup()
    with pytest.raises(SystemExit, match="tts:scheduler_policy: policy must be one of voxserve, "):
        TritonServer(parameters={"tts": {"scheduler_policy": "fastest"}}, use_mps=False)
    with pytest.raises(SystemExit, match="--policy: policy must be one of voxserve, "):
        TritonServer(policy="fastest", use_mps=False)
    with pytest.raises(SystemExit, match="--policy serial and tts:scheduler_policy=voxserve disagree"):
        TritonServer(policy="serial", parameters={"tts": {"scheduler_policy": "voxserve"}}, use_mps=False)
    assert set(Path(tempfile.gettempdir()).glob("voxtriton-*")) <= workdirs


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
def test_serve_starts_answers_and_stops_cleanly(tiny_checkpoint, tmp_path):
    grpc, http, metrics = free_ports(3)
    env = {**os.environ, "VOXTRITON_CACHE": str(tmp_path / "cache")}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "voxtriton.cli",
            "serve",
            "--checkpoint",
            str(tiny_checkpoint),
            "--grpc-port",
            str(grpc),
            "--http-port",
            str(http),
            "--metrics-port",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        lines = read_until_ready(launcher)
        assert any("voxtriton: ready" in line for line in lines), "".join(lines)
        assert "voxtriton: starting tritonserver" in lines[0] + lines[1], "".join(lines)  # after the warning
        assert f"gRPC 127.0.0.1:{grpc}" in "".join(lines)
        workdir = next(line.split("log: ")[1].strip() for line in lines if "log: " in line)
        workdir = str(Path(workdir).parent)
        synthesis = TTSClient(f"127.0.0.1:{grpc}").synthesize(
            "Hello from the launcher test.", max_frames=10, ignore_eos=True, seed=1
        )
        assert synthesis.completed and len(synthesis.audio) == 10 * 1920
        assert processes_mentioning(workdir), "tritonserver should be running from the rendered repository"
        # SIGTERM drains: a stream in flight ends with all its audio before the server stops.
        started, results = threading.Event(), {}
        speaker = threading.Thread(
            target=lambda: results.update(
                long=TTSClient(f"127.0.0.1:{grpc}").synthesize(
                    "Still speaking.", max_frames=80, ignore_eos=True, on_chunk=lambda chunk: started.set()
                )
            )
        )
        speaker.start()
        assert started.wait(60)
        launcher.send_signal(signal.SIGTERM)
        speaker.join(60)
        assert results["long"].error is None and len(results["long"].audio) == 80 * 1920
        assert launcher.wait(60) == 0
        rest = launcher.stdout.read()
        assert "voxtriton: stopping: no new requests" in rest and "every stream has ended" in rest, rest
        time.sleep(1)
        assert processes_mentioning(workdir) == [], "SIGTERM must stop tritonserver and its stubs"
        assert not Path(workdir).exists()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.server
def test_a_signal_while_the_server_starts_stops_it_at_once(tiny_checkpoint, tmp_path):
    """Ctrl-C during a start (minutes on a GPU: kernels, graphs, warm-ups) ends it then, not once the
    server is ready, and leaves no tritonserver behind."""
    env = {**os.environ, "VOXTRITON_CACHE": str(tmp_path / "cache")}
    ports = [str(port) for port in free_ports(3)]
    command = [sys.executable, "-m", "voxtriton.cli", "serve", "--checkpoint", str(tiny_checkpoint)]
    command += ["--grpc-port", ports[0], "--http-port", ports[1], "--metrics-port", ports[2]]
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (started := children(launcher.pid)):  # tritonserver launched, not ready yet
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(60) != 0
        output = launcher.stdout.read()
        assert "voxtriton: stopped before it was ready" in output and "voxtriton: ready" not in output, output
        deadline = time.monotonic() + 15
        while left := [pid for pid in started if Path(f"/proc/{pid}").exists()]:
            states = [Path(f"/proc/{pid}/stat").read_text(errors="replace")[:80] for pid in left]
            assert time.monotonic() < deadline, f"left running: {states}"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_a_stop_told_to_give_up_kills_a_server_that_has_not_exited(tiny_checkpoint):
    """`voxtriton serve`'s third signal: no wait for the rest of the grace (a server unloading its
    models, here a process that ignores SIGTERM) before the kill."""
    server = TritonServer(checkpoint=str(tiny_checkpoint))
    ignoring = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True)"
    command = [sys.executable, "-c", ignoring + "; time.sleep(120)"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout.readline() == b"1\n"  # SIGTERM is ignored from here on
        server.process = process
        started = time.monotonic()
        server.stop(grace=60, give_up=lambda: time.monotonic() > started + 0.5)
        assert time.monotonic() - started < 30 and process.returncode == -signal.SIGKILL
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        server.cleanup()


@pytest.mark.parametrize(
    "visible, expected", [(None, 2), ("1", 1), ("0,1", 2), ("", 0), ("-1", 0), ("0,1,2,3", 2)]
)
def test_gpu_count_honours_cuda_visible_devices(two_gpus, monkeypatch, visible, expected):
    """A stand-in nvidia-smi lists two GPUs; CUDA_VISIBLE_DEVICES limits what the server may use
    (the disaggregated policy puts its codec on a second GPU only when it may use one)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_count() == expected


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that lists two GPUs."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
@pytest.mark.parametrize(
    "policy, gpu, visible, expected",
    [("disaggregated", None, None, 2), ("disaggregated", None, "1", 1), ("disaggregated", 0, None, 1)]
    + [("voxserve", None, None, 1), ("tts:scheduler_policy=disaggregated", None, None, 2)],
)
def test_a_server_counts_the_gpus_it_computes_on(two_gpus, monkeypatch, policy, gpu, visible, expected):
    """Two GPUs visible: disaggregated's codec models take the second, so its server runs on two (what
    the benchmarks count per GPU); one visible or the server pinned to one, it runs on one. The policy
    set as a tts parameter places the codec models as `--policy` does."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    parameters = parse_params([policy]) if "=" in policy else None
    server = TritonServer(
        policy=None if parameters else policy, parameters=parameters, gpu=gpu, use_mps=False
    )
    try:
        lane = (server.repository / "codec_urgent" / "config.pbtxt").read_text()
        assert server.gpus == expected
        assert ('key: "device" value: { string_value: "cuda:1" }' in lane) == (expected == 2)
    finally:
        server.cleanup()


def codec_configs(parameters: dict | None = None) -> tuple[str, str]:
    """The config.pbtxt of codec_urgent and codec_background in the repository a server with
    `parameters` would run (the server is not started)."""
    server = TritonServer(parameters=parameters, use_mps=False)
    try:
        return tuple(
            (server.repository / model / "config.pbtxt").read_text()
            for model in ("codec_urgent", "codec_background")
        )
    finally:
        server.cleanup()


@pytest.mark.server  # builds a TritonServer: needs the tritonserver install
def test_the_codecs_capture_the_shapes_the_scheduler_will_ask_for():
    """A chunk schedule or batch limits given for tts set the codecs' graph shapes, each up to its own
    lane's limit, unless given for them."""
    urgent, background = codec_configs(
        {
            "tts": {
                "scheduler_chunk_schedule": "1,1,2,2,4,25",
                "scheduler_max_batch": "24",
                "scheduler_background_max_batch": "48",
            },
            "codec_background": {"graph_batch_sizes": "4,24"},
        }
    )
    for config in (urgent, background):
        assert 'key: "graph_frame_sizes" value: { string_value: "1,2,4,25" }' in config
    assert 'key: "graph_batch_sizes" value: { string_value: "1,2,4,8,16,24" }' in urgent
    assert 'key: "graph_batch_sizes" value: { string_value: "4,24" }' in background
    # only voxserve's background lane makes the larger calls
    urgent, background = codec_configs({"tts": {"scheduler_background_max_batch": "48"}})
    assert 'key: "graph_batch_sizes" value: { string_value: "1,2,4,8,16" }' in urgent
    assert 'key: "graph_batch_sizes" value: { string_value: "1,2,4,8,16,32,48" }' in background
    assert "graph_frame_sizes" not in urgent + background
    # 1-frame first chunks: on the urgent lane only, which decodes every first chunk
    urgent, background = codec_configs({"tts": {"scheduler_single_frame_start_streams": "8"}})
    assert 'key: "graph_frame_sizes" value: { string_value: "1,2,4,8,16,25" }' in urgent
    assert 'key: "graph_frame_sizes" value: { string_value: "2,4,8,16,25" }' in background
    urgent, _ = codec_configs()  # nothing given: the repository's own shapes
    assert "1,2,4,25" not in urgent and "16,24" not in urgent


@pytest.mark.parametrize("model", ["embedded", "custom_voice", "base", "csm"])
def test_the_ready_hint_registers_a_voice_only_for_a_model_without_speakers(
    model, tiny_checkpoint, tiny_base_checkpoint, tmp_path
):
    """A model with speakers of its own is asked to speak at once; a Base model needs a voice first."""
    from voxtriton.models.csm.checkpoint import make_csm_checkpoint

    checkpoint = {
        "embedded": lambda: None,
        "custom_voice": lambda: tiny_checkpoint,
        "base": lambda: tiny_base_checkpoint,
        "csm": lambda: make_csm_checkpoint("csm-tiny", tmp_path / "csm"),
    }[model]()
    hint = first_request_hint(checkpoint and str(checkpoint), "localhost:8001", {})
    lines = hint.splitlines()
    if model == "base":
        assert "voices add anna" in lines[0] and lines[1].endswith("--speaker anna")
        # paths with spaces are quoted, so the hint can be pasted
        spaced = shutil.copytree(checkpoint, tmp_path / "my base")
        hint = first_request_hint(str(spaced), "localhost:8001", {"tts": {"voices_dir": "my voices"}})
        assert hint.splitlines()[0].endswith(f"--checkpoint '{spaced}' --voices-dir 'my voices'")
    else:
        assert len(lines) == 1 and " speak " in lines[0] and "--speaker" not in lines[0]


def test_free_ports_are_distinct_and_avoid_the_taken_ones():
    """A server's three ports are picked together: one at a time, the system may hand a port out
    twice (Triton then refuses to start: gRPC and metrics on one port)."""
    ports = free_ports(40)
    assert len(set(ports)) == 40
    taken = tuple(ports[:10])
    assert not set(free_ports(20, taken=taken)) & set(taken)
