"""CSM end to end: a real tritonserver serving a random-weight `csm-tiny` checkpoint (the family picked
from its config.json), tritonclient gRPC streaming through voxtriton_client.

Same contract as Qwen3-TTS: `text`, `speaker` (CSM's speaker id), `seed`, `max_frames`, sampling;
the fields CSM does not take are refused naming them, and the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import pytest
import torch
from server_helpers import start_server
from test_gateway import (
    browser,  # noqa: F401 (a fixture)
    fetch,
    get,
    open_playground,
    post,
    screenshot,
    start_gateway,
    stop_gateway,
)
from test_server import raw_request, string_input
from voxtriton_client import TTSClient

from voxtriton.models.csm.checkpoint import make_csm_checkpoint
from voxtriton.models.families import load_family

pytestmark = pytest.mark.server

TEXT = "Good morning, this is the first voice."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0)


@pytest.fixture(scope="module")
def server(checkpoint):
    with start_server(checkpoint) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return TTSClient(server.grpc_url)


@pytest.fixture(scope="module")
def gateway(server):
    """No --checkpoint: the gateway reads the backend's checkpoint and lists the family's offer."""
    process, url = start_gateway(server.grpc_url)
    try:
        yield url
    finally:
        stop_gateway(process)


def speak(client, text, seed, frames=30, **options):
    return client.synthesize(
        text, speaker="1", seed=seed, max_frames=frames, ignore_eos=True, codes=True, info=True, **options
    ).raise_for_error()


def test_streams_csm_chunks_whose_audio_is_the_whole_decode_of_their_codes(client, checkpoint):
    synthesis = speak(client, TEXT, seed=1, frames=30)
    assert synthesis.completed and len(synthesis.chunks) >= 3
    assert synthesis.codes.shape == (30, 32)
    assert len(synthesis.audio) == 30 * 1920
    info = np.stack([c.info for c in synthesis.chunks])
    assert list(info[:, 1]) == list(np.cumsum([0] + list(info[:-1, 2])))  # in order, exactly once
    # The codec lanes decoded chunk by chunk with carried state: the same audio as one whole decode.
    mimi = load_family(checkpoint).load_codec()
    codes = torch.from_numpy(synthesis.codes.astype(np.int64))[None]
    whole, _ = mimi.decode(codes, torch.zeros(1, dtype=torch.long), mimi.new_state(1))
    assert np.abs(whole[0].numpy() - synthesis.audio).max() <= 1e-4
    assert np.abs(synthesis.audio).max() > 0.01


def test_greedy_codes_are_the_models_greedy_codes(client, checkpoint):
    """temperature 0 over the server gives the CSM model's own greedy frames for the same prompt."""
    family = load_family(checkpoint)
    synthesis = speak(client, TEXT, seed=0, frames=8, temperature=0.0)
    prompt = torch.tensor([family.prompt.build(TEXT, "1")])
    expected = family.load_backbone().generate(prompt, 8, lambda logits, codebook: logits.argmax(dim=-1))
    np.testing.assert_array_equal(synthesis.codes, expected[0].numpy())


def test_same_seed_gives_the_same_codes_and_another_seed_others(client):
    first, second = speak(client, TEXT, seed=5), speak(client, TEXT, seed=5)
    np.testing.assert_array_equal(first.codes, second.codes)
    np.testing.assert_array_equal(first.audio, second.audio)
    assert not np.array_equal(first.codes, speak(client, TEXT, seed=6).codes)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("language", "english", "language: CSM takes no language"),
        ("instruct", "Speak softly.", "instruct: CSM takes no style instruction"),
        ("reference_audio", b"RIFF", "reference_audio: CSM serves its speakers by id"),
        ("speaker", "ryan", "speaker: 'ryan' is not a speaker id"),
    ],
)
def test_fields_csm_does_not_take_are_refused_naming_them(server, client, field, value, message):
    error = raw_request(server.grpc_url, [string_input("text", "hi"), string_input(field, value)])
    assert error is not None and message in error, error
    assert speak(client, "still serving", seed=1, frames=3).completed


def test_an_input_stream_is_refused_naming_the_reason(client):
    synthesis = client.synthesize_text_stream(["Hello ", "there."], speaker="0", max_frames=4)
    assert synthesis.error is not None and "CSM reads its text whole" in synthesis.error
    assert speak(client, "still serving", seed=2, frames=3).completed


def test_the_gateway_lists_what_the_csm_model_offers_and_speaks_by_speaker_id(gateway):
    _, _, models = get(gateway, "/v1/models")
    offers = models["data"][0]["offers"]
    assert offers["family"] == "csm" and offers["codebooks"] == 32 and offers["sample_rate"] == 24000
    assert set(offers["fields"]) >= {"text", "speaker", "seed", "max_frames"}
    assert {"language", "instruct", "reference_audio"} <= set(offers["refused"])
    assert not offers["input_streaming"] and not offers["clones_voices"]
    assert offers["speakers"] == ["0", "1"] and models["data"][0]["voices"] == ["0", "1"]
    body = {
        "input": "Hello.",
        "voice": "1",
        "max_frames": 6,
        "ignore_eos": True,
        "response_format": "pcm",
    }
    code, _, payload = post(gateway, body)
    assert code == 200 and len(payload) == 6 * 1920 * 2
    code, _, error = post(gateway, {**body, "instructions": "Whisper."})
    assert code == 400 and b"instruct" in error and b"CSM takes no style instruction" in error


def test_the_gateways_text_stream_says_csm_reads_its_text_whole(gateway):
    from websockets.sync.client import connect

    with connect(gateway.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=10) as socket:
        socket.send(json.dumps({"input": "Hello ", "voice": "0", "max_frames": 4}))
        socket.send(json.dumps({"input": "there.", "end": True}))
        while isinstance(message := socket.recv(timeout=60), bytes):
            pass
    error = json.loads(message)
    assert error["type"] == "error" and error["error"]["param"] == "input", error
    assert "CSM reads its text whole" in error["error"]["message"]
    assert get(gateway, "/v1/models")[0] == 200  # still serving


def test_the_gateway_lists_csm_speaker_ids_as_its_voices_and_refuses_registering_one(gateway):
    code, _, listing = get(gateway, "/v1/audio/voices")
    assert code == 200 and listing == {
        "object": "list",
        "data": [{"name": "0", "speaker": True}, {"name": "1", "speaker": True}],
    }
    body = {"name": "anna", "audio": base64.b64encode(b"RIFF").decode(), "text": "Hi."}
    code, _, payload = post(gateway, body, "/v1/audio/voices")
    error = json.loads(payload)["error"]
    assert code == 400 and error["param"] == "audio", error
    assert error["message"] == (
        "audio: the served model takes no reference audio, so it registers no voices "
        "(CSM serves its speakers by id; it clones no voice); its speakers: 0, 1"
    )
    code, _, payload = fetch(urllib.request.Request(f"{gateway}/v1/audio/voices/anna", method="DELETE"))
    error = json.loads(payload)["error"]
    assert code == 404 and error["param"] == "name" and error["type"] == "not_found_error"
    assert error["message"].startswith("name: no voice 'anna': the served model takes no reference audio")
    assert get(gateway, "/v1/audio/voices")[0] == 200  # still serving


def test_the_playground_offers_csm_speaker_ids_and_hides_what_csm_does_not_take(gateway, browser):  # noqa: F811
    page = open_playground(browser, gateway, ignore_eos=True, seed=4)
    requests = []
    page.on("request", lambda r: requests.append(r.post_data_json) if r.method == "POST" else None)
    page.wait_for_function("document.getElementById('voice').options.length > 1")
    options = page.eval_on_selector_all("#voice option", "options => options.map(o => [o.value, o.text])")
    assert options == [["", "server default"], ["0", "speaker 0"], ["1", "speaker 1"]]
    # No reference audio, no instruction and no input streams for CSM: their controls are hidden.
    assert page.is_hidden("#clone") and page.is_hidden("#instruct-control")
    assert page.is_hidden("#as-typed-control")
    page.select_option("#voice", "1")
    page.fill("#seconds", "1.6")
    page.click("#speak")
    page.wait_for_function("window.voxtritonStats.done", timeout=60_000)
    stats = page.evaluate("window.voxtritonStats")
    screenshot(page, "playground-csm.png")
    page.close()
    assert stats["error"] is None and stats["samples"] == 20 * 1920, stats
    assert requests[0]["voice"] == "1" and "instructions" not in requests[0]
