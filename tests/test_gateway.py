"""The OpenAI-compatible gateway in front of a real server: OpenAI client, curl, errors, health, page."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np
import pytest
import soundfile
from server_helpers import start_server, wait_for_metric
from voxtriton_client import TTSClient

from voxtriton.models.config import load_config
from voxtriton.models.families import load_family
from voxtriton.serving.gateway import MODEL_ALIASES
from voxtriton.serving.launcher import TritonServer, free_port
from voxtriton.serving.settings import TTSSettings, default_checkpoint_dir

pytestmark = pytest.mark.server


def start_gateway(
    backend: str, checkpoint=None, healthy: bool = True, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """A gateway on a free port, once it answers /health: with 200 when `healthy`, with anything else not."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "voxtriton.cli",
        "gateway",
        "--port",
        str(port),
        "--backend",
        backend,
        *extra,
    ]
    if checkpoint is not None:
        command += ["--checkpoint", str(checkpoint)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return process, url
        except urllib.error.HTTPError:
            if not healthy:
                return process, url
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(process.stdout.read())


def stop_gateway(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with start_server(tiny_checkpoint) as server:
        # No --checkpoint: the gateway learns the voices from the backend's own checkpoint.
        gateway, url = start_gateway(server.grpc_url)
        try:
            yield url, server
        finally:
            stop_gateway(gateway)


def post(url: str, body: dict, path: str = "/v1/audio/speech") -> tuple[int, dict, bytes]:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return fetch(request)


def get(url: str, path: str) -> tuple[int, dict, dict]:
    status, headers, payload = fetch(urllib.request.Request(url + path))
    return status, headers, json.loads(payload)


def fetch(request: urllib.request.Request) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def sse_events(payload: bytes) -> list[dict]:
    blocks = payload.decode().split("\n\n")
    assert blocks[-1] == ""  # every event ends with its blank line
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


def test_openai_client_streams_pcm(stack):
    from openai import OpenAI

    url, first = stack
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
    url, _ = stack
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
        ({"model": "tts", "input": "hi", "voice": "ryan", "response_format": "aac"}, 400, "response_format"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "speed": 1.5}, 400, "speed"),
        ({"model": "tts", "input": "hi", "voice": "alloy"}, 400, "voice"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "language": "klingon"}, 400, "language"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "max_frames": "many"}, 400, "max_frames"),
        ({"model": "whisper-1", "input": "hi", "voice": "ryan"}, 400, "model"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "speeed": 1.0}, 400, "speeed"),
        ({"model": "tts", "input": "hi", "voice": "ryan", "stream_format": "chunks"}, 400, "stream_format"),
    ],
)
def test_errors_map_to_status_codes_with_json_bodies(stack, body, status, param):
    url, _ = stack
    code, headers, payload = post(url, body)
    assert code == status
    error = json.loads(payload)["error"]
    assert error["param"] == param and error["message"].startswith(param)


UNREADABLE_JSON = (  # Python refuses both with errors that are not JSONDecodeError
    b'{"model": "tts", "input": "hi", "seed": 1' + b"0" * 5000 + b"}",  # a number of 5001 digits
    b"[" * 100_000,  # nesting past the recursion limit
)


def test_json_past_pythons_limits_is_a_bad_request(stack):
    url, _ = stack
    for body in UNREADABLE_JSON:
        request = urllib.request.Request(url + "/v1/audio/speech", data=body)
        status, _, payload = fetch(request)
        assert status == 400 and json.loads(payload)["error"]["message"] == "request body must be JSON"


def open_post(url: str, headers: dict, body_pieces: list[bytes], timeout: float = 120) -> socket.socket:
    """A socket of its own that has sent a POST to /v1/audio/speech: its head, then `body_pieces`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = "".join(f"{name}: {value}\r\n" for name, value in {"Host": host, **headers}.items())
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(f"POST /v1/audio/speech HTTP/1.1\r\n{head}\r\n".encode())
    for piece in body_pieces:
        sock.sendall(piece)
    return sock


def post_and_read(url: str, headers: dict, body_pieces: list[bytes]) -> tuple[int, bytes]:
    """`open_post`, the answer read after `body_pieces` went out, the body left unfinished: the
    server has then read all it was sent when it answers, so its close cannot reset the connection
    (and lose the answer) under the client's writes."""
    with open_post(url, headers, body_pieces) as sock:
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def test_a_body_past_the_limit_is_refused_declared_or_chunked(stack):
    """413 for a speech request of more than 1 MiB, whether its length is declared (refused before
    its body is read) or it comes in chunks (no Content-Length: refused once past the limit)."""
    from voxtriton.serving.gateway import MAX_SPEECH_BODY_BYTES

    url, _ = stack
    piece = b"x" * 65536
    chunked = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (MAX_SPEECH_BODY_BYTES // len(piece) + 1)
    for headers, pieces in (
        ({"Content-Length": str(MAX_SPEECH_BODY_BYTES + 1000)}, []),
        ({"Transfer-Encoding": "chunked"}, chunked),
    ):
        status, payload = post_and_read(url, {"Content-Type": "application/json", **headers}, pieces)
        assert status == 413, status
        assert json.loads(payload)["error"]["message"] == f"request body too large (at most {1 << 20} bytes)"


def test_empty_text_pieces_do_not_reach_the_server(stack):
    """A text stream's empty later messages are dropped at the gateway: the server gets as many
    requests for a stream with 30 of them as for one without."""
    from websockets.sync.client import connect

    url, server = stack
    requests = 'nv_inference_request_success{model="tts",version="1"}'

    def requests_for(empty: int) -> float:
        before = server.metrics()[requests]
        with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as socket:
            socket.send(json.dumps({"input": "Hello", "voice": "ryan", "max_frames": 8, "ignore_eos": True}))
            for _ in range(empty):
                socket.send(json.dumps({"input": ""}))
            socket.send(json.dumps({"input": " there.", "end": True}))
            while isinstance(message := socket.recv(timeout=60), bytes):
                pass
        assert json.loads(message)["type"] == "speech.audio.done", message
        return server.metrics()[requests] - before

    assert requests_for(30) == requests_for(0)


def test_a_text_stream_without_a_first_message_is_closed(monkeypatch):
    """A WebSocket opened and left silent gets an error and is closed after the first-message
    timeout (30 s; shortened here), in process: no backend is asked before the first message."""
    from fastapi.testclient import TestClient

    from voxtriton.serving import gateway

    monkeypatch.setattr(gateway, "FIRST_MESSAGE_TIMEOUT_S", 0.2)
    with TestClient(gateway.create_app("127.0.0.1:1")).websocket_connect("/v1/audio/speech/stream") as socket:
        message = socket.receive_json()
    assert message["type"] == "error" and message["error"]["message"] == "no first message within 0.2 s"


def test_busy_servers_answer_503(tiny_checkpoint):
    limits = {"max_streams": "1", "max_queued": "0", "max_frames": "100"}
    with start_server(tiny_checkpoint, parameters={"tts": limits}) as server:
        gateway, url = start_gateway(server.grpc_url, tiny_checkpoint)
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
            _, _, models = get(url, "/v1/models")  # the voices of the --checkpoint given
        finally:
            stop_gateway(gateway)
    codes = sorted(code for code, _, _ in results)
    assert 200 in codes and 503 in codes
    busy = next(r for r in results if r[0] == 503)
    assert busy[1].get("retry-after") == "1" or busy[1].get("Retry-After") == "1"
    error = json.loads(busy[2])["error"]
    assert (
        error["type"] == "server_busy" and error["message"] == "The voxtriton server is busy; retry shortly."
    )
    assert models["data"][0]["voices"] == sorted(load_config(tiny_checkpoint).talker.speakers)
    assert models["data"][0]["offers"]["max_frames"] == 100  # the server's limit, not the checkpoint's


def test_models_list_the_voices_of_a_server_run_without_a_checkpoint(tmp_path, monkeypatch):
    """`voxtriton serve` with no --checkpoint leaves tts's checkpoint_dir empty, which Triton's JSON
    config omits: the gateway then reads the default checkpoint's voices."""
    monkeypatch.setenv("VOXTRITON_CACHE", str(tmp_path))  # the server and the gateway share it
    with TritonServer(use_mps=False) as server:
        gateway, url = start_gateway(server.grpc_url)
        try:
            status, _, models = get(url, "/v1/models")
        finally:
            stop_gateway(gateway)
    assert status == 200
    assert models["data"][0]["voices"] == sorted(load_config(default_checkpoint_dir()).talker.speakers)


def test_models_list_the_served_model_its_aliases_and_the_backends_voices(stack, tiny_checkpoint):
    import openai

    url, _ = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    [card] = client.models.list().data
    voices = sorted(load_config(tiny_checkpoint).talker.speakers)
    assert (card.id, card.object, card.owned_by) == ("tts", "model", "voxtriton")
    assert card.aliases == list(MODEL_ALIASES) and card.voices == voices and "ryan" in voices
    # the checkpoint's default length (8192 frames) held to the server's limit
    assert (
        card.offers["max_frames"] == TTSSettings.max_frames < load_family(tiny_checkpoint).sampling.max_frames
    )
    assert client.models.retrieve("gpt-4o-mini-tts").id == "tts"
    with pytest.raises(openai.NotFoundError, match="unknown model 'whisper-1'"):
        client.models.retrieve("whisper-1")


def test_the_voices_of_a_model_that_clones_none_are_its_speakers_and_registering_is_refused(
    stack, tiny_checkpoint
):
    """A CustomVoice checkpoint: the voice list is its preset speakers; a registration or a deletion
    says the model takes no reference audio."""
    url, _ = stack
    speakers = sorted(load_config(tiny_checkpoint).talker.speakers)
    code, _, listing = get(url, "/v1/audio/voices")
    assert code == 200 and listing["data"] == [{"name": name, "speaker": True} for name in speakers]
    body = {"name": "anna", "audio": base64.b64encode(b"RIFF").decode()}
    code, _, payload = post(url, body, "/v1/audio/voices")
    error = json.loads(payload)["error"]
    assert code == 400 and error["param"] == "audio", error
    assert error["message"].startswith("audio: the served model takes no reference audio"), error
    assert "its speakers: " + ", ".join(speakers) in error["message"]
    code, _, payload = fetch(urllib.request.Request(f"{url}/v1/audio/voices/ryan", method="DELETE"))
    error = json.loads(payload)["error"]
    assert code == 404 and error["param"] == "name" and "takes no reference audio" in error["message"]


def test_openai_model_names_and_voices_in_any_case_are_the_served_ones(stack):
    url, _ = stack
    body = {"input": "Same voice.", "max_frames": 12, "ignore_eos": True, "seed": 3, "response_format": "pcm"}

    def audio(model: str, voice: str) -> np.ndarray:
        code, _, payload = post(url, {**body, "model": model, "voice": voice})
        assert code == 200, payload
        return np.frombuffer(payload, "<i2").astype(np.int32)

    served = audio("tts", "ryan")
    assert len(served) == 12 * 1920
    for model, voice in (("tts-1", "Ryan"), ("tts-1-hd", "RYAN"), ("gpt-4o-mini-tts", "ryan")):
        assert np.abs(audio(model, voice) - served).max() <= 7  # both backends: float rounding aside
    assert np.abs(audio("tts", "serena") - served).max() > 1000  # the voice matters


def test_sse_events_carry_the_audio_and_each_chunks_lane(stack):
    url, _ = stack
    body = dict(model="tts", input="Events.", voice="ryan", max_frames=30, ignore_eos=True, seed=4)
    code, headers, payload = post(url, {**body, "response_format": "pcm", "stream_format": "sse"})
    assert code == 200 and headers["content-type"].startswith("text/event-stream")
    *deltas, done = sse_events(payload)
    assert done == {"type": "speech.audio.done"} and len(deltas) >= 2
    chunks = [delta["chunk"] for delta in deltas]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert [c["first_frame"] for c in chunks] == [
        sum(c["frames"] for c in chunks[:i]) for i in range(len(chunks))
    ]
    assert sum(c["frames"] for c in chunks) == 30
    assert chunks[0]["lane"] == "urgent" and {c["lane"] for c in chunks} <= {"urgent", "background", "inline"}
    pieces = [base64.b64decode(delta["audio"]) for delta in deltas]
    assert [len(piece) for piece in pieces] == [c["frames"] * 1920 * 2 for c in chunks]
    code, _, plain = post(url, {**body, "response_format": "pcm"})
    streamed, plain = np.frombuffer(b"".join(pieces), "<i2"), np.frombuffer(plain, "<i2")
    assert (
        code == 200 and len(streamed) == len(plain) and np.abs(streamed - plain.astype(np.int32)).max() <= 7
    )
    # As a WAV, the first event carries the header: the events' audio joined is the file.
    code, _, payload = post(url, {**body, "max_frames": 4, "stream_format": "sse"})
    wav = b"".join(base64.b64decode(e["audio"]) for e in sse_events(payload)[:-1])
    assert code == 200 and wav[:4] == b"RIFF" and len(wav) == 44 + 4 * 1920 * 2


def test_opus_streams_compressed_audio_chunk_by_chunk(stack):
    """`opus` is Ogg Opus of the asked length at a fraction of pcm's bytes; as events, every chunk's
    delta carries its encoded audio and one last delta closes the Ogg stream."""
    url, _ = stack
    body = dict(model="tts", input="Compressed.", voice="ryan", max_frames=30, ignore_eos=True, seed=4)
    code, headers, payload = post(url, {**body, "response_format": "opus"})
    assert code == 200 and headers["content-type"] == "audio/ogg" and payload[:4] == b"OggS"
    code, _, plain = post(url, {**body, "response_format": "pcm"})
    plain = np.frombuffer(plain, "<i2") / 32767.0
    with soundfile.SoundFile(io.BytesIO(payload)) as decoded:
        assert (decoded.samplerate, decoded.channels, decoded.frames) == (24000, 1, 30 * 1920)
        samples = decoded.read(dtype="float32")
    assert len(payload) < len(plain) * 2 / 4 and np.corrcoef(samples, plain)[0, 1] > 0.5
    code, _, events = post(url, {**body, "response_format": "opus", "stream_format": "sse"})
    *deltas, closing, done = sse_events(events)
    assert code == 200 and done == {"type": "speech.audio.done"} and "chunk" not in closing
    assert sum(delta["chunk"]["frames"] for delta in deltas) == 30 and len(deltas) >= 2
    pieces = [base64.b64decode(event["audio"]) for event in deltas + [closing]]
    assert all(pieces)
    with soundfile.SoundFile(io.BytesIO(b"".join(pieces))) as decoded:  # the same audio (another serial)
        np.testing.assert_array_equal(decoded.read(dtype="float32"), samples)


def test_the_openai_client_gets_mp3(stack):
    """OpenAI's default format: MP3 frames as the chunks come, decoding to the audio (after the
    encoder's delay) at a fraction of pcm's bytes."""
    from openai import OpenAI

    url, _ = stack
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    options = dict(model="tts", voice="ryan", input="Hello in MP3.")
    extra = {"max_frames": 30, "ignore_eos": True, "seed": 4}
    with client.audio.speech.with_streaming_response.create(
        **options, response_format="mp3", extra_body=extra
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        pieces = list(response.iter_bytes())
    mp3 = b"".join(pieces)
    samples, rate = soundfile.read(io.BytesIO(mp3), dtype="float32")
    assert rate == 24000 and abs(len(samples) - 30 * 1920) < 0.15 * 24000
    code, _, plain = post(url, {**options, **extra, "response_format": "pcm"})
    assert code == 200 and len(mp3) < len(plain) / 5


def test_the_gateway_takes_one_backend_and_says_where_several_go():
    """Several servers are balanced by a proxy in front of them, not by the gateway."""
    command = [sys.executable, "-m", "voxtriton.cli", "gateway", "--port", str(free_port())]
    command += ["--backend", "127.0.0.1:8001", "--backend", "127.0.0.1:8002"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert completed.returncode != 0
    assert "give one --backend" in completed.stderr and "proxy" in completed.stderr, completed.stderr


@pytest.fixture(scope="module")
def no_backend():
    """A gateway whose one backend is down."""
    gateway, url = start_gateway(f"127.0.0.1:{free_port()}", healthy=False)
    try:
        yield url
    finally:
        stop_gateway(gateway)


UNAVAILABLE = "No voxtriton server is ready; retry when one is up."


def test_without_a_ready_backend_every_endpoint_says_so_in_one_sentence(no_backend):
    code, headers, health = get(no_backend, "/health")
    assert code == 503 and health["status"] == "unavailable" and not health["backend"]["ready"]
    assert health["error"]["message"] == UNAVAILABLE and headers.get("retry-after") == "1"
    code, _, models = get(no_backend, "/v1/models")
    assert code == 503 and models["error"]["message"] == UNAVAILABLE
    code, headers, payload = post(no_backend, {"model": "tts", "input": "Anyone?", "max_frames": 4})
    error = json.loads(payload)["error"]
    assert code == 503 and headers.get("retry-after") == "1"
    assert error == {"message": UNAVAILABLE, "type": "service_unavailable", "param": None, "code": None}


def test_a_text_stream_no_server_takes_says_so_and_closes_with_retry_later(no_backend):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(
        no_backend.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10
    ) as socket:
        socket.send(json.dumps({"input": "Anyone?", "max_frames": 4, "end": True}))
        end = json.loads(socket.recv(timeout=30))
        assert end["type"] == "error" and end["error"]["type"] == "service_unavailable", end
        with pytest.raises(ConnectionClosed):
            socket.recv(timeout=10)
        assert socket.close_code == 1013


def test_a_path_or_method_the_gateway_lacks_gets_the_errors_shape(no_backend):
    status, headers, payload = fetch(urllib.request.Request(no_backend + "/v1/audio/speech"))
    error = json.loads(payload)["error"]
    assert (status, headers["allow"], error["type"]) == (405, "POST", "invalid_request_error")
    assert error["message"] == "GET /v1/audio/speech: Method Not Allowed"
    status, _, payload = fetch(urllib.request.Request(no_backend + "/v1/nothing/here"))
    error = json.loads(payload)["error"]
    assert (status, error["type"], error["message"]) == (
        404,
        "not_found_error",
        "GET /v1/nothing/here: Not Found",
    )


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FRAMES = 40  # 3.2 s of audio in several chunks
LANE_COLORS = {"var(--urgent)", "var(--background)", "var(--inline)"}
SCREENSHOTS = os.environ.get("VOXTRITON_SCREENSHOTS")  # a folder: the browser tests save their pages there


API_KEY = "vx-test-key"


@pytest.fixture(scope="module")
def keyed(stack):
    """A second gateway in front of the same server, started with --api-key."""
    _, server = stack
    gateway, url = start_gateway(server.grpc_url, extra=("--api-key", API_KEY))
    try:
        yield url
    finally:
        stop_gateway(gateway)


def test_a_gateway_with_an_api_key_refuses_v1_requests_without_it(keyed):
    """/v1/ needs 'Authorization: Bearer KEY' (401 in OpenAI's shape otherwise, voices' routes
    included); the playground page and /health do not; the OpenAI client sends its api_key so."""
    from openai import AuthenticationError, OpenAI

    def models(headers: dict) -> tuple[int, dict, dict]:
        status, response_headers, payload = fetch(
            urllib.request.Request(keyed + "/v1/models", headers=headers)
        )
        return status, response_headers, json.loads(payload)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, response_headers, body = models(headers)
        assert status == 401 and response_headers["www-authenticate"] == "Bearer", (headers, status)
        assert body["error"]["code"] == "invalid_api_key" and "Authorization" in body["error"]["message"]
    assert models({"Authorization": f"Bearer {API_KEY}"})[0] == 200
    status, _, _ = fetch(urllib.request.Request(keyed + "/v1/audio/voices", data=b"{}", method="POST"))
    assert status == 401
    assert fetch(urllib.request.Request(keyed + "/health"))[0] == 200
    assert fetch(urllib.request.Request(keyed + "/"))[0] == 200

    options = dict(model="tts", voice="ryan", input="Hello.", response_format="pcm")
    extra = {"max_frames": 8, "ignore_eos": True, "seed": 4}
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keyed + "/v1", api_key="wrong").audio.speech.create(**options, extra_body=extra)
    speech = OpenAI(base_url=keyed + "/v1", api_key=API_KEY).audio.speech.create(**options, extra_body=extra)
    assert len(speech.content) == 8 * 1920 * 2


def test_the_text_stream_websocket_takes_the_key_as_a_header_or_in_its_first_message(keyed):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    def speak(first: dict, headers: dict | None = None) -> tuple[int, dict]:
        url = keyed.replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(url, open_timeout=10, additional_headers=headers) as socket:
            socket.send(json.dumps({"input": "Hello", "voice": "ryan", "max_frames": 8, **first}))
            with contextlib.suppress(ConnectionClosed):  # a refused key: the gateway may have closed
                socket.send(json.dumps({"input": " there.", "end": True}))
            audio = 0
            while isinstance(message := socket.recv(timeout=60), bytes):
                audio += len(message)
            return audio, json.loads(message)

    for first in ({}, {"api_key": "wrong"}):
        audio, end = speak(first)
        assert audio == 0 and end["type"] == "error" and end["error"]["code"] == "invalid_api_key", end
    for first, headers in (({"api_key": API_KEY}, None), ({}, {"Authorization": f"Bearer {API_KEY}"})):
        audio, end = speak({**first, "ignore_eos": True}, headers)
        assert end["type"] == "speech.audio.done" and audio == 8 * 1920 * 2, end


def test_past_its_open_requests_limit_the_gateway_answers_busy_and_keeps_serving(stack):
    """--max-connections 1: a socket that has sent nothing holds no slot; while one text stream is
    open, a speech request gets the gateway's 503 and a second text stream an error and close code
    1013; /health still answers; once the stream ends, requests pass again."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    _, server = stack
    gateway, url = start_gateway(server.grpc_url, extra=("--max-connections", "1"))
    stream_url = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    speech = dict(model="tts", voice="ryan", input="Hello.", response_format="pcm", max_frames=4)
    first = {"input": "Hello", "voice": "ryan", "max_frames": 8, "ignore_eos": True}
    try:
        with connect(stream_url, open_timeout=10), connect(stream_url, open_timeout=10) as held:
            assert post(url, speech)[0] == 200  # beside a silent socket
            held.send(json.dumps(first))
            deadline = time.monotonic() + 10  # the held stream takes its slot once its message is read
            while (reply := post(url, speech))[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            status, headers, payload = reply
            assert (status, headers["retry-after"]) == (503, "1")
            error = json.loads(payload)["error"]
            assert error["type"] == "server_busy" and "1 requests open" in error["message"], error
            with connect(stream_url, open_timeout=10) as refused:
                refused.send(json.dumps(first))
                error = json.loads(refused.recv(timeout=10))
                assert error["type"] == "error" and "1 requests open" in error["error"]["message"], error
                with pytest.raises(ConnectionClosed):
                    refused.recv(timeout=10)
                assert refused.close_code == 1013
            assert fetch(urllib.request.Request(url + "/health"))[0] == 200
            held.send(json.dumps({"input": " there.", "end": True}))
            audio = 0
            while isinstance(message := held.recv(timeout=60), bytes):
                audio += len(message)
            assert json.loads(message)["type"] == "speech.audio.done" and audio == 8 * 1920 * 2
        deadline = time.monotonic() + 10  # the held stream's handler returns after its close
        while (status := post(url, speech)[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200
    finally:
        stop_gateway(gateway)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (installed by .ci/run)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--autoplay-policy=no-user-gesture-required",
                "--use-fake-ui-for-media-stream",  # a microphone (a test tone) the page may record
                "--use-fake-device-for-media-stream",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


def open_playground(browser, url: str, **pinned):
    """The playground, with `pinned` fields written into its speech requests in flight."""
    page = browser.new_page(viewport={"width": 1000, "height": 640})
    if pinned:
        page.route(
            "**/v1/audio/speech",
            lambda route: route.continue_(
                post_data=json.dumps({**json.loads(route.request.post_data), **pinned})
            ),
        )
    page.goto(url + "/")
    return page


def screenshot(page, name: str) -> None:
    if SCREENSHOTS:
        page.screenshot(path=os.path.join(SCREENSHOTS, name), full_page=True)


def test_playground_plays_streamed_audio_in_a_browser(stack, browser):
    url, _ = stack
    # A random-weight model may sample its end-of-speech code after one chunk: the page's request in
    # flight gets ignore_eos and a seed, and its length control sets max_frames.
    page = open_playground(browser, url, ignore_eos=True, seed=7)
    requests = []
    page.on("request", lambda r: requests.append(r.post_data_json) if r.method == "POST" else None)
    page.wait_for_function("document.getElementById('voice').options.length > 1")  # the backend's voices
    # What the model offers: the tiny CustomVoice checkpoint takes instruct and input streams, no clones.
    assert page.is_visible("#instruct-control") and page.is_visible("#as-typed-control")
    assert page.is_hidden("#clone")
    page.select_option("#voice", "ryan")
    page.fill("#instruct", "Speak slowly.")
    page.fill("#text", "The browser plays this as it streams.")
    page.fill("#seconds", str(FRAMES * 0.08))
    page.click("#speak")
    assert page.is_disabled("#speak") and page.is_enabled("#stop")
    page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
    stats = page.evaluate("window.voxtritonStats")
    status_line = page.inner_text("#stats")
    # The chart: one arrival dot per chunk, in its lane's colour; Speak comes back when playback ends.
    dots = page.eval_on_selector_all("#chart circle", "circles => circles.map(c => c.getAttribute('fill'))")
    page.wait_for_function("!document.getElementById('speak').disabled", timeout=30_000)
    screenshot(page, "playground.png")
    page.close()
    assert stats["error"] is None, stats
    assert requests[0]["voice"] == "ryan" and requests[0]["instructions"] == "Speak slowly."
    assert stats["samples"] == FRAMES * 1920 and stats["chunks"] >= 2  # all of it reached WebAudio, streamed
    assert 0 < stats["ttfaMs"] < 10_000 and "TTFA" in status_line
    assert len(dots) == stats["chunks"] and set(dots) <= LANE_COLORS
    assert sum(stats["lanes"].values()) == stats["chunks"] and "lanes:" in status_line


def test_playground_asks_for_the_api_key_of_a_gateway_that_needs_one(keyed, browser):
    page = open_playground(browser, keyed, ignore_eos=True, seed=7)
    page.wait_for_function("!document.getElementById('key-control').hidden")
    assert (
        "API key" in page.inner_text("#status")
        and page.eval_on_selector("#status", "s => s.className") == "error"
    )
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('voice').options.length > 1")  # the voices, with the key
    page.fill("#seconds", str(8 * 0.08))
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
    stats = page.evaluate("window.voxtritonStats")
    screenshot(page, "playground-api-key.png")
    page.close()
    assert stats["error"] is None and stats["samples"] == 8 * 1920, stats


def test_playground_stop_ends_the_stream_on_the_server(stack, browser):
    url, server = stack
    page = open_playground(browser, url, ignore_eos=True)
    requests = []
    page.on(
        "request",
        lambda request: requests.append(request.post_data_json) if request.method == "POST" else None,
    )
    page.fill("#seconds", "60")
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.chunks >= 2", timeout=60_000)
    page.click("#stop")
    page.wait_for_function("window.voxtritonStats.state === 'stopped'", timeout=10_000)
    status, stop_enabled, speak_enabled = (
        page.inner_text("#status"),
        page.is_enabled("#stop"),
        page.is_enabled("#speak"),
    )
    page.close()
    assert requests[0]["max_frames"] == 750  # 60 s at 12.5 frames a second
    assert status == "Stopped." and speak_enabled and not stop_enabled
    # The gateway cancelled the request it was streaming.
    wait_for_metric(server, "voxtriton_active_streams", lambda value: value == 0)


def test_playground_speaks_as_the_text_is_typed(stack, browser):
    """Speak as I type: words go over the gateway's WebSocket as they are typed, and the first audio
    plays before the text is finished."""
    url, _ = stack
    page = browser.new_page(viewport={"width": 1000, "height": 640})

    def pin(route):  # a random-weight model: the first message gets ignore_eos and a seed in flight
        server = route.connect_to_server()

        def forward(message):
            body = json.loads(message)
            if "model" in body:  # the first message carries the options
                body.update(ignore_eos=True, seed=7)
            server.send(json.dumps(body))

        route.on_message(forward)

    page.route_web_socket("**/v1/audio/speech/stream", pin)
    page.goto(url + "/")
    page.fill("#seconds", "3")
    page.check("#as-typed")
    page.click("#speak")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Type;')")
    page.locator("#text").press_sequentially("Spoken while it is still being typed, word by word", delay=100)
    page.locator("#text").press("Enter")
    page.locator("#text").press_sequentially(" more", delay=50)  # after the end: sent nowhere
    page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
    stats = page.evaluate("window.voxtritonStats")
    page.locator("#text").fill("Spoken while it is still being typed, word by word")
    screenshot(page, "playground-as-typed.png")
    page.close()
    assert stats["state"] == "done" and stats["error"] is None, stats
    assert stats["samples"] == 38 * 1920  # 3 s at 12.5 frames a second, rounded: max_frames 38
    assert 0 < stats["ttfaMs"] < stats["lastPieceMs"], stats  # speech began before the text ended


def served_events(*events: dict):
    """A route handler answering the page's speech request with these SSE events."""
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events)
    return lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body)


ONE_CHUNK = {
    "type": "speech.audio.delta",
    "audio": base64.b64encode(bytes(2 * 1920)).decode(),
    "chunk": {"index": 0, "first_frame": 0, "frames": 1, "lane": "urgent"},
}
BROKEN = {"type": "error", "error": {"message": "The voxtriton server stopped answering mid-request."}}
PAGE_ERRORS = {  # what goes wrong -> (how the page is set up for it, what it must say)
    "empty text": (lambda page: page.fill("#text", "   "), "Error: input: must be a non-empty string"),
    "bad length": (
        lambda page: page.fill("#seconds", "0"),
        "Error: Length: give a number of seconds above 0",
    ),
    "no connection": (
        lambda page: page.route("**/v1/audio/speech", lambda route: route.abort()),
        "Error: network error, the gateway did not answer",
    ),
    "cut short": (
        lambda page: page.route("**/v1/audio/speech", served_events(ONE_CHUNK)),
        "Error: the stream ended before its last event",
    ),
    "failed mid-stream": (
        lambda page: page.route("**/v1/audio/speech", served_events(ONE_CHUNK, BROKEN)),
        "Error: The voxtriton server stopped answering mid-request.",
    ),
}


@pytest.mark.parametrize("case", PAGE_ERRORS)
def test_playground_shows_every_error(stack, browser, case):
    url, _ = stack
    setup, expected = PAGE_ERRORS[case]
    page = open_playground(browser, url)
    setup(page)
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.done && !document.getElementById('speak').disabled")
    status, classes = page.inner_text("#status"), page.get_attribute("#status", "class")
    stats = page.evaluate("window.voxtritonStats")
    page.close()
    assert status.startswith(expected) and classes == "error"
    assert stats["state"] == "error" and stats["error"] == status


def test_playground_without_a_backend_says_so(no_backend, browser):
    page = open_playground(browser, no_backend)
    page.wait_for_function("document.getElementById('status').classList.contains('error')")
    listing = page.inner_text("#status")
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.done")
    speaking = page.inner_text("#status")
    screenshot(page, "playground-no-backend.png")
    page.close()
    assert listing == f"Could not list the voices: {UNAVAILABLE}"
    assert speaking == f"Error: {UNAVAILABLE}"


def test_a_stream_that_fails_after_its_audio_began_is_aborted_not_ended(tiny_checkpoint):
    """The 200 has gone out with the first chunk; a later codec failure must not look like a complete,
    shorter answer: the gateway ends the body without its last chunk, which clients see as an error."""
    faulty = {"codec_urgent": {"test_fault": "raise:2"}, "tts": {"scheduler_policy": "concurrent"}}
    with start_server(tiny_checkpoint, parameters=faulty) as server:
        gateway, url = start_gateway(server.grpc_url, tiny_checkpoint)
        try:
            body = {"model": "tts", "input": "Cut short.", "max_frames": 40, "ignore_eos": True}
            request = urllib.request.Request(
                url + "/v1/audio/speech",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 200
                with pytest.raises(http.client.IncompleteRead) as cut:
                    response.read()
            assert len(cut.value.partial) > 0  # the first chunk's audio arrived before the failure
            _, _, health = get(url, "/health")  # and the gateway goes on serving
            assert health["status"] == "ok"
        finally:
            stop_gateway(gateway)


def test_a_text_stream_message_past_its_limit_closes_the_socket(stack):
    """A message over 64 KiB (the server takes 8 KiB of text in all) is refused by the WebSocket
    layer, before it is parsed or its key checked: close code 1009, and the gateway goes on."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url, _ = stack
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as socket:
        socket.send(json.dumps({"input": "x" * (70 << 10)}))
        with pytest.raises(ConnectionClosed):
            socket.recv(timeout=30)
        assert socket.close_code == 1009
    assert fetch(urllib.request.Request(url + "/health"))[0] == 200


def test_a_message_after_the_last_piece_ends_the_text_stream_with_an_error(stack):
    from websockets.sync.client import connect

    url, _ = stack
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as socket:
        first = {"input": "Hello there.", "voice": "ryan", "max_frames": 400, "ignore_eos": True, "end": True}
        socket.send(json.dumps(first))
        socket.send(json.dumps({"input": " And more."}))
        while isinstance(message := socket.recv(timeout=60), bytes):
            pass
    error = json.loads(message)
    assert error["type"] == "error", error
    assert (error["error"]["param"], error["error"]["message"]) == (
        "end",
        "end: no message may follow the last piece",
    )


def test_a_text_streams_first_message_of_the_wrong_shape_gets_its_error_and_a_close():
    """In process (no backend is asked before the first message parses): a response_format that is
    not a string is named, not a dropped socket."""
    from fastapi.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from voxtriton.serving.gateway import create_app

    with TestClient(create_app("127.0.0.1:1")).websocket_connect("/v1/audio/speech/stream") as socket:
        socket.send_json({"input": "Hi", "response_format": ["pcm"]})
        error = socket.receive_json()
        with pytest.raises(WebSocketDisconnect) as closed:
            socket.receive_json()
    assert error["type"] == "error" and error["error"]["param"] == "response_format", error
    assert closed.value.code == 1000


def test_a_body_that_never_ends_gets_a_408_and_gives_its_place_back(stack):
    """--body-timeout 1 and one open request at most: an upload that stops short of its declared
    length is answered 408 after a second, and the next request is served."""
    _, server = stack
    gateway, url = start_gateway(server.grpc_url, extra=("--body-timeout", "1", "--max-connections", "1"))
    try:
        headers = {"Content-Type": "application/json", "Content-Length": "100"}
        status, payload = post_and_read(url, headers, [b'{"in'])
        assert status == 408, payload
        assert json.loads(payload)["error"]["message"] == "request body not received within 1 s"
        speech = dict(model="tts", voice="ryan", input="Hello.", response_format="pcm", max_frames=4)
        assert post(url, speech)[0] == 200
    finally:
        stop_gateway(gateway)


def test_a_request_whose_client_leaves_before_its_first_audio_leaves_the_servers_queue(tiny_checkpoint):
    """One row, taken by a long stream: a second request waits in the server's queue for it. Its
    client goes away meanwhile; the gateway cancels it then, so it leaves the queue while the first
    stream still runs (not once a row frees and its first chunk is made for nobody)."""
    limits = {"max_streams": "1", "max_queued": "2"}
    with start_server(tiny_checkpoint, parameters={"tts": limits}) as server:
        gateway, url = start_gateway(server.grpc_url)
        long_speech = dict(model="tts", voice="ryan", input="Long.", response_format="pcm", ignore_eos=True)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(post, url, {**long_speech, "max_frames": 1500})
                wait_for_metric(server, "voxtriton_kv_rows_in_use", lambda rows: rows == 1)
                body = json.dumps({**long_speech, "max_frames": 8}).encode()
                headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
                with open_post(url, headers, [body], timeout=30):  # closed unanswered
                    wait_for_metric(server, "voxtriton_waiting_requests", lambda waiting: waiting == 1)
                wait_for_metric(server, "voxtriton_waiting_requests", lambda waiting: waiting == 0)
                assert not first.done()  # it left the queue before the row was free
                assert first.result(timeout=300)[0] == 200
        finally:
            stop_gateway(gateway)
