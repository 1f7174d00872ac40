"""The OpenAI-compatible gateway in front of real servers: official client, curl, errors, routing, playground."""

from __future__ import annotations

import concurrent.futures
import io
import json
import shutil
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np
import pytest
from server_helpers import start_server
from voxtriton_client import TTSClient

from voxtriton.serving.launcher import free_port

pytestmark = pytest.mark.server


def start_gateway(backends: list[str], checkpoint) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "voxtriton.cli",
        "gateway",
        "--port",
        str(port),
        "--checkpoint",
        str(checkpoint),
    ]
    for backend in backends:
        command += ["--backend", backend]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(process.stdout.read())


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with start_server(tiny_checkpoint) as first, start_server(tiny_checkpoint) as second:
        gateway, url = start_gateway([first.grpc_url, second.grpc_url], tiny_checkpoint)
        try:
            yield url, first, second
        finally:
            gateway.terminate()
            gateway.wait(10)


def post(url: str, body: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(
        url + "/v1/audio/speech", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_openai_client_streams_pcm(stack):
    from openai import OpenAI

    url, first, _ = stack
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    pieces = []
    with client.audio.speech.with_streaming_response.create(
        model="tts",
        voice="ryan",
        input="Hello through the OpenAI client.",
        response_format="pcm",
        extra_body={"max_frames": 30, "ignore_eos": True, "seed": 4},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        for piece in response.iter_bytes():
            pieces.append(piece)
    pcm = np.frombuffer(b"".join(pieces), "<i2")
    assert len(pcm) == 30 * 1920 and len(pieces) >= 2
    # The same request straight to Triton gives the same audio (16-bit rounding aside).
    direct = TTSClient(first.grpc_url).synthesize(
        "Hello through the OpenAI client.", speaker="ryan", max_frames=30, ignore_eos=True, seed=4
    )
    assert np.abs(pcm / 32767.0 - direct.audio).max() < 2e-4


def test_curl_gets_a_playable_wav(stack, tmp_path):
    url, _, _ = stack
    out = tmp_path / "speech.wav"
    body = json.dumps(
        {
            "model": "tts",
            "input": "Curl wants a wav file.",
            "voice": "serena",
            "max_frames": 25,
            "ignore_eos": True,
        }
    )
    subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "-X",
            "POST",
            url + "/v1/audio/speech",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            "-o",
            str(out),
            "--fail-with-body",
        ],
        check=True,
        timeout=120,
    )
    data = out.read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    with wave.open(io.BytesIO(data[:44] + b"")) as header:  # header fields
        assert (header.getframerate(), header.getnchannels(), header.getsampwidth()) == (24000, 1, 2)
    assert len(data) - 44 == 25 * 1920 * 2


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tts", "input": "", "voice": "ryan"}, 400, "input"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "response_format": "mp3"}, 400, "response_format"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "speed": 1.5}, 400, "speed"),
        ({"model": "tts", "input": "hi", "voice": "alloy"}, 400, "voice"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "language": "klingon"}, 400, "language"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "max_frames": "many"}, 400, "max_frames"),
    ],
)
def test_errors_map_to_status_codes_with_json_bodies(stack, body, status, param):
    url, _, _ = stack
    code, headers, payload = post(url, body)
    assert code == status
    error = json.loads(payload)["error"]
    assert error["param"] == param and error["message"].startswith(param)


def test_requests_are_spread_over_backends(stack):
    url, first, second = stack
    body = {
        "model": "tts",
        "input": "Spread the load.",
        "voice": "ryan",
        "max_frames": 30,
        "ignore_eos": True,
    }
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post(url, body), range(4)))
    assert all(code == 200 and len(payload) == 44 + 30 * 1920 * 2 for code, _, payload in results)

    def served(server) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as response:
            lines = response.read().decode().splitlines()
        return sum(
            float(line.split()[-1]) for line in lines if line.startswith("voxtriton_ttfa_seconds_count")
        )

    assert served(first) >= 1 and served(second) >= 1


def test_busy_servers_answer_503(tiny_checkpoint):
    with start_server(tiny_checkpoint, parameters={"tts": {"max_streams": "1", "max_queued": "0"}}) as server:
        gateway, url = start_gateway([server.grpc_url], tiny_checkpoint)
        try:
            body = {
                "model": "tts",
                "input": "Only one at a time.",
                "voice": "ryan",
                "max_frames": 60,
                "ignore_eos": True,
            }
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda _: post(url, body), range(4)))
        finally:
            gateway.terminate()
            gateway.wait(10)
    codes = sorted(code for code, _, _ in results)
    assert 200 in codes and 503 in codes
    busy = next(r for r in results if r[0] == 503)
    assert busy[1].get("retry-after") == "1" or busy[1].get("Retry-After") == "1"
    assert json.loads(busy[2])["error"]["type"] == "server_busy"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FRAMES = 40  # 3.2 s of audio in several chunks


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (installed by .ci/run)")
def test_playground_plays_streamed_audio_in_a_browser(stack):
    from playwright.sync_api import sync_playwright

    url, _, _ = stack
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--autoplay-policy=no-user-gesture-required",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page()
        # The page asks for free-running speech; a random-weight model may then sample its end-of-speech
        # code after one chunk. Pin the length and seed of the page's own request in flight instead.
        page.route(
            "**/v1/audio/speech",
            lambda route: route.continue_(
                post_data=json.dumps(
                    {
                        **json.loads(route.request.post_data),
                        "max_frames": FRAMES,
                        "ignore_eos": True,
                        "seed": 7,
                    }
                )
            ),
        )
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('voice').options.length > 0")
        page.fill("#text", "The browser plays this as it streams.")
        page.click("#speak")
        page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
        stats = page.evaluate("window.voxtritonStats")
        status_line = page.inner_text("#stats")
        browser.close()
    assert stats["error"] is None, stats
    assert stats["samples"] == FRAMES * 1920 and stats["chunks"] >= 2  # all of it reached WebAudio, streamed
    assert 0 < stats["ttfaMs"] < 10_000 and "TTFA" in status_line
