"""Checks benchmarks/serving_bench.py makes of a server before measuring it (no server)."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from voxtriton.bench.fleet import kernel_fallbacks
from voxtriton.bench.summary import summarize
from voxtriton.bench.targets import Endpoint, Utterance, played
from voxtriton.serving.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]

# Lines of a real server log whose environment had a CC that named no compiler.
FALLBACK = (
    "2026-12-03 14:05:08,646 voxtriton WARNING voxtriton.kernels: Triton kernel decode_attention unavailable "
    "on cuda:0 (FileNotFoundError: [Errno 2] No such file or directory: '--param "
    "tts:scheduler_chunk_schedule=2,2,4,8,16,25'); using its slower PyTorch formula"
)
GREEN_CONTEXT = (
    "2026-12-03 14:05:08,695 voxtriton INFO voxtriton.serving.runtime: using a green context of 96 of 132 SMs"
)
GRAPHS = (
    "2026-12-03 14:05:22,090 voxtriton INFO voxtriton: tts: captured 28 frame-step, 16 prefill, 32 admission "
    "and 2 row-move CUDA graphs"
)


def test_a_gpu_kernel_that_failed_its_check_is_found_in_the_server_log():
    log = "\n".join([GREEN_CONTEXT, FALLBACK, FALLBACK.replace("decode_attention", "rotary"), GRAPHS])
    assert kernel_fallbacks(log) == [FALLBACK, FALLBACK.replace("decode_attention", "rotary")]


def test_a_log_without_fallbacks_gives_none():
    assert kernel_fallbacks("\n".join([GREEN_CONTEXT, GRAPHS])) == []


def test_a_gpu_without_the_triton_package_logs_every_kernel_as_a_fallback(monkeypatch, caplog):
    """Without triton the kernels fall back too: each says so in the log, which the benchmark reads.
    (check_kernels touches no GPU before it finds triton missing, so this runs on CPU.)"""
    import voxtriton.kernels.registry as kernels

    monkeypatch.setattr(kernels, "triton", None)
    with caplog.at_level(logging.WARNING, logger=kernels.log.name):
        usable = kernels.check_kernels(torch.device("cuda", 0))
    assert usable and not any(usable.values())
    found = kernel_fallbacks("\n".join(record.getMessage() for record in caplog.records))
    assert len(found) == len(usable) and all("cannot be imported" in line for line in found)


def test_an_endpoint_that_is_down_ends_the_run_saying_so(tmp_path):
    """--target openai starts nothing: with nothing listening at --url it measures nothing, exits
    non-zero and names the URL and the failure, and writes no results."""
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, str(ROOT / "benchmarks" / "serving_bench.py"), "--target", "openai"]
    command += ["--url", url, "--model", "tts", "--rates", "2", "--out", str(tmp_path / "bench")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert f"openai at {url} did not serve a test request" in completed.stderr
    assert "ConnectError" in completed.stderr
    assert not (tmp_path / "bench" / "results.json").exists()


def test_the_openai_target_refuses_incomplete_or_malformed_options(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("serving_bench", ROOT / "benchmarks" / "serving_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for options, message in (
        (["--target", "openai", "--model", "tts"], "--target openai needs --url"),
        (["--target", "openai", "--url", "http://x", "--model", "m", "--extra-body", "[1]"], "JSON object"),
        (["--target", "openai", "--url", "http://x", "--model", "m", "--extra-body", "{"], "not JSON"),
        (["--target", "openai", "--url", "http://x", "--model", "m", "--smoke"], "--smoke starts a server"),
        (["--checkpoint", "x", "--goodput-rules", "strict,loose"], "--goodput-rules: loose"),
        (["--checkpoint", "x", "--text-tail-frames", "4"], "--text-tail-frames: 0 or more frames, with"),
        (["--checkpoint", "x", "--text-rate", "20", "--text-tail-frames", "-1"], "--text-tail-frames: 0 or"),
        (["--checkpoint", "x", "--gpus", "2"], "--gpus: an endpoint's GPU count (--target openai)"),
        (["--target", "openai", "--url", "http://x", "--model", "m", "--gpus", "-1"], "at least 0, got -1"),
    ):
        monkeypatch.setattr(sys, "argv", ["serving_bench.py", "--out", str(tmp_path), *options])
        with pytest.raises(SystemExit) as exit:
            bench.main()
        assert exit.value.code == 2 and message in capsys.readouterr().err, options


def test_a_request_body_carries_the_fixed_length_in_the_field_named():
    utterance = Utterance("Hello.", frames=50, seed=7)
    ours = Endpoint("http://gw", "tts").body(utterance, "ryan")
    assert ours == {
        "model": "tts",
        "input": "Hello.",
        "response_format": "pcm",
        "ignore_eos": True,
        "voice": "ryan",
        "max_frames": 50,
        "seed": 7,
    }
    peer = Endpoint(
        "http://peer", "/ck", {"task_type": "CustomVoice", "stream": True}, "max_new_tokens", seed_field=""
    ).body(utterance, None)
    assert peer == {
        "model": "/ck",
        "input": "Hello.",
        "response_format": "pcm",
        "task_type": "CustomVoice",
        "stream": True,
        "max_new_tokens": 50,
    }


def test_a_stream_that_ends_well_short_of_its_length_counts_as_failed():
    # 10 s asked; pieces of 1 s arriving every 0.5 s from 50 ms on (no stall).
    def pieces(seconds):
        return [(0.05 + 0.5 * i, 1.0) for i in range(seconds)]

    one_frame_less = played(0.0, pieces(9) + [(4.55, 0.92)], None, asked_s=10.0)
    half = played(0.0, pieces(5), None, asked_s=10.0)
    assert one_frame_less.error is None
    assert half.error == "ended short: 5.00 s of audio of the 10.00 s asked for"
    summary = summarize([one_frame_less, half], lag=[])
    assert (summary["completed"], summary["failed"], summary["slo_attained"]) == (1, 1, 1)
    assert summary["errors"] == [half.error]


class PacedSpeech(http.server.BaseHTTPRequestHandler):
    """A speech endpoint that writes its body in the pieces of `PIECES` (bytes, then seconds to
    wait), each flushed as a chunk of its own."""

    PIECES: list = []
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for data, pause in self.PIECES:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(pause)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("split", ["whole", "a byte first"])
def test_the_openai_target_counts_audio_from_its_first_whole_sample(split):
    """A read that ends inside the first sample is no audio yet: TTFA is when the sample is whole,
    and the playback has no gap there. A WAV body (its header is no audio) is refused."""
    frame = b"\x01\x00" * 1920  # one frame of 16-bit samples at 24 kHz: 80 ms
    first = [(frame[:1], 0.1), (frame[1:], 0.0)] if split == "a byte first" else [(frame, 0.0)]
    utterance = Utterance("Hi.", frames=2, seed=0)
    outcomes = []
    for pieces in (first + [(frame, 0.0)], [(b"RIFF" + bytes(40), 0.0), (frame * 2, 0.0)]):
        PacedSpeech.PIECES = pieces
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PacedSpeech)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            target = Endpoint(f"http://127.0.0.1:{server.server_port}", "tts").make_target()

            async def one():
                try:
                    return await target.request(utterance, None, time.perf_counter())
                finally:
                    await target.close()

            outcomes.append(asyncio.run(one()))
        finally:
            server.shutdown()
    played_pcm, wav = outcomes
    assert played_pcm.error is None and played_pcm.stall_s == 0 and played_pcm.audio_s == pytest.approx(0.16)
    assert played_pcm.ttfa_s >= (0.1 if split == "a byte first" else 0.0)
    assert wav.error == "the body is a WAV file, not raw pcm"
