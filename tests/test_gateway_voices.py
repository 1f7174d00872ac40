"""Registered voices through the gateway, in front of a real server with a random tiny-base checkpoint
(its audio is noise): register, list, speak with the OpenAI `voice` field, delete, and the refusals."""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import pytest
from server_helpers import start_server
from test_clone_parity import reference_audio
from test_clone_server import REFERENCE_TEXT, audio_file
from test_gateway import (
    UNREADABLE_JSON,
    browser,  # noqa: F401 (a fixture)
    fetch,
    get,
    open_playground,
    post,
    screenshot,
    start_gateway,
    stop_gateway,
)
from voxtriton_client import TTSClient

pytestmark = pytest.mark.server

TEXT = "The gateway speaks with a registered voice."


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    """The directory the server reads voices from and the stack's gateway registers them in."""
    return tmp_path_factory.mktemp("gateway-voices")


@pytest.fixture(scope="module")
def stack(tiny_base_checkpoint, voices):
    with start_server(tiny_base_checkpoint, parameters={"tts": {"voices_dir": str(voices)}}) as server:
        gateway, url = start_gateway(
            server.grpc_url, tiny_base_checkpoint, extra=("--voices-dir", str(voices))
        )
        try:
            yield url, server
        finally:
            stop_gateway(gateway)


def delete(url: str, name: str) -> tuple[int, dict]:
    status, _, payload = fetch(urllib.request.Request(f"{url}/v1/audio/voices/{name}", method="DELETE"))
    return status, json.loads(payload)


def registration(name: str, recording: bytes, **fields) -> dict:
    return {"name": name, "audio": base64.b64encode(recording).decode(), **fields}


def test_register_speak_list_and_delete(stack):
    from openai import OpenAI

    url, server = stack
    recording = audio_file(reference_audio(2.0, seed=9))
    status, _, payload = post(
        url, registration("narrator", recording, text=REFERENCE_TEXT), "/v1/audio/voices"
    )
    assert status == 201, payload
    assert json.loads(payload) == {
        "name": "narrator",
        "seconds": 2.0,
        "in_context": True,
        "text": REFERENCE_TEXT,
    }
    assert get(url, "/v1/audio/voices")[2]["data"][0]["name"] == "narrator"
    assert "narrator" in get(url, "/v1/models")[2]["data"][0]["voices"]

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    with client.audio.speech.with_streaming_response.create(
        model="tts",
        voice="narrator",
        input=TEXT,
        response_format="pcm",
        extra_body={"max_frames": 20, "ignore_eos": True, "seed": 5},
    ) as response:
        pcm = np.frombuffer(response.read(), "<i2")
    # The registered voice is the inline reference, encoded once.
    inline = TTSClient(server.grpc_url).synthesize(
        TEXT, reference_audio=recording, reference_text=REFERENCE_TEXT, max_frames=20, ignore_eos=True, seed=5
    )
    assert len(pcm) == 20 * 1920 and np.abs(inline.audio).max() > 0.01
    assert np.abs(pcm / 32767.0 - inline.audio).max() < 2e-4

    assert delete(url, "narrator") == (200, {"name": "narrator", "deleted": True})
    status, body = delete(url, "narrator")
    assert status == 404 and body["error"]["param"] == "name"
    status, _, payload = post(url, {"model": "tts", "input": TEXT, "voice": "narrator"})
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "voice" and "unknown voice 'narrator'" in error["message"]
    # No voice at all: a Base model's request names the gateway's field, not the server's input.
    status, _, payload = post(url, {"model": "tts", "input": TEXT})
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "voice", error
    assert (
        error["message"] == "voice: this model clones voices: name a registered one (POST /v1/audio/voices)"
    )


@pytest.mark.parametrize(
    "body,param,message",
    [
        (registration("../etc/passwd", b"x"), "name", "is not a voice name"),
        ({"name": "a", "audio": "not base64!"}, "audio", "not valid base64"),
        ({"name": "a", "audio": "data:audio/wav;base64"}, "audio", "audio: is empty"),
        (registration("text", b"plain words"), "audio", "audio: not an audio file that can be read"),
        (registration("quiet", audio_file(np.zeros(48000, np.float32))), "audio", "audio: is silent"),
        (registration("short", audio_file(reference_audio(0.4))), "audio", "audio: too short"),
        (registration("a", audio_file(reference_audio(1.0)), voice="x"), "voice", "unknown field"),
        (
            registration("a", audio_file(reference_audio(1.0)), text="Hi \ud800."),
            "text",
            "text: not valid Unicode (a lone surrogate at character 3)",
        ),
    ],
    ids=[
        "path-name",
        "not-base64",
        "data-url-without-data",
        "not-audio",
        "silent",
        "too-short",
        "unknown-field",
        "lone-surrogate",
    ],
)
def test_bad_registrations_are_refused_naming_the_field(stack, body, param, message):
    url, _ = stack
    status, _, payload = post(url, body, "/v1/audio/voices")
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == param and message in error["message"], error


def test_a_registration_past_pythons_json_limits_is_a_bad_request(stack):
    url, _ = stack
    for body in UNREADABLE_JSON:
        status, _, payload = fetch(urllib.request.Request(url + "/v1/audio/voices", data=body))
        assert status == 400 and json.loads(payload)["error"]["message"] == "request body must be JSON"


def test_a_name_is_registered_once_unless_replaced(stack):
    url, _ = stack
    first = registration("twice", audio_file(reference_audio(1.0, seed=1)))
    assert post(url, first, "/v1/audio/voices")[0] == 201
    status, _, payload = post(url, first, "/v1/audio/voices")
    assert status == 400 and "exists" in json.loads(payload)["error"]["message"]
    assert post(url, {**first, "replace": True}, "/v1/audio/voices")[0] == 201
    assert delete(url, "twice")[0] == 200


def registered(url: str) -> list[str]:
    return [voice["name"] for voice in get(url, "/v1/audio/voices")[2]["data"] if not voice.get("speaker")]


def test_a_gateway_registers_at_most_max_voices(stack, voices, tiny_base_checkpoint):
    """--max-voices bounds the voices directory as the servers' max_voices does; a replacement and a
    registration after a deletion still pass."""
    shared, server = stack
    room = len(registered(shared)) + 1  # the voices other tests left, and one more
    gateway, url = start_gateway(
        server.grpc_url, tiny_base_checkpoint, extra=("--voices-dir", str(voices), "--max-voices", str(room))
    )
    try:
        recording = audio_file(reference_audio(1.0, seed=2))
        assert post(url, registration("first", recording), "/v1/audio/voices")[0] == 201
        status, _, payload = post(url, registration("second", recording), "/v1/audio/voices")
        error = json.loads(payload)["error"]
        assert (status, error["param"]) == (400, "name") and f"full ({room} voices)" in error["message"]
        assert post(url, registration("first", recording, replace=True), "/v1/audio/voices")[0] == 201
        assert delete(url, "first")[0] == 200
        assert post(url, registration("second", recording), "/v1/audio/voices")[0] == 201
        assert delete(url, "second")[0] == 200
    finally:
        stop_gateway(gateway)


def test_a_gateway_writing_where_the_server_does_not_read_says_so_and_registers_nothing(
    stack, voices, tiny_base_checkpoint, tmp_path
):
    """A gateway whose --voices-dir is not the server's voices_dir (or on another host, sharing
    none): a registration would be a voice that every request then finds unknown. It is refused with
    the reason and nothing is written, also when the server already has a voice of that name (the
    question is whether the server reads this gateway's files, not the name), and the gateway goes
    on serving."""
    shared, server = stack
    recording = audio_file(reference_audio(1.0, seed=3))
    assert post(shared, registration("both", recording), "/v1/audio/voices")[0] == 201
    gateway, url = start_gateway(server.grpc_url, tiny_base_checkpoint, extra=("--voices-dir", str(tmp_path)))
    try:
        for name, fields in (("elsewhere", {}), ("both", {"replace": True})):
            status, _, payload = post(url, registration(name, recording, **fields), "/v1/audio/voices")
            error = json.loads(payload)["error"]
            assert (status, error["type"]) == (500, "server_error"), payload
            assert f"writes in {tmp_path}" in error["message"], error
            assert error["message"].endswith("nothing was registered"), error
        assert registered(url) == [] and not list(tmp_path.iterdir())  # nor the probe left behind
        assert (voices / "both.npz").exists()  # the server's own voice of that name, untouched
        body = {"model": "tts", "input": "Still here.", "voice": "both", "max_frames": 4, "ignore_eos": True}
        assert post(shared, body)[0] == 200  # and speaking, as before
    finally:
        stop_gateway(gateway)
        delete(shared, "both")


def wait_for_clone_status(page, start: str) -> str:
    page.wait_for_function(
        f"document.getElementById('clone-status').textContent.startsWith({json.dumps(start)})", timeout=60_000
    )
    return page.inner_text("#clone-status")


def test_playground_registers_an_upload_and_a_recording_and_speaks_with_them(stack, browser, tmp_path):  # noqa: F811
    url, _ = stack
    upload = tmp_path / "reference.wav"
    upload.write_bytes(audio_file(reference_audio(2.0, seed=11)[::3], rate=8000))
    page = open_playground(browser, url, ignore_eos=True, seed=3)
    page.wait_for_function("document.body.dataset.family === 'qwen3_tts'")  # the model card was read
    # A Base model clones voices and takes no instruction (its voice comes from the reference).
    assert page.is_visible("#clone") and page.is_hidden("#instruct-control")
    page.click("#clone summary")
    page.click("#register")
    assert wait_for_clone_status(page, "Error") == "Error: record or choose a file first"

    page.fill("#clone-name", "uploaded")
    page.set_input_files("#clone-file", str(upload))
    assert wait_for_clone_status(page, "reference.wav") == "reference.wav: 2.00 s, ready to register."
    page.fill("#clone-transcript", REFERENCE_TEXT)
    page.click("#register")
    assert wait_for_clone_status(page, "Registered") == "Registered uploaded (2.00 s, in context)."
    assert page.input_value("#voice") == "uploaded"
    page.fill("#seconds", "1.6")
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
    stats = page.evaluate("window.voxtritonStats")
    assert stats["error"] is None and stats["samples"] == 20 * 1920, stats

    page.fill("#clone-name", "recorded")
    page.fill("#clone-transcript", "")
    page.click("#record")
    wait_for_clone_status(page, "Recording…")
    page.wait_for_timeout(1800)
    page.click("#record")
    assert wait_for_clone_status(page, "Recording:").endswith("ready to register.")
    page.click("#register")
    assert wait_for_clone_status(page, "Registered").endswith("x-vector only).")
    screenshot(page, "playground-clone.png")
    page.close()
    names = [voice["name"] for voice in get(url, "/v1/audio/voices")[2]["data"]]
    assert {"uploaded", "recorded"} <= set(names)
    for name in ("uploaded", "recorded"):
        assert delete(url, name)[0] == 200
