"""CSM end to end: a real tritonserver serving a random-weight `csm-tiny` checkpoint (the family picked
from its config.json), tritonclient gRPC streaming through voxtriton_client.

Same contract as Qwen3-TTS: `text`, `speaker` (CSM's speaker id, or a registered voice), `seed`,
`max_frames`, sampling, `reference_audio` with its required `reference_text` (a context turn spoken
by `speaker`); the fields CSM does not take are refused naming them, and the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import pytest
import torch
from server_helpers import start_server
from test_clone_parity import reference_audio
from test_clone_server import audio_file
from test_csm import engine_codes
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

from voxtriton.engine.engine import Engine
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.models.csm.checkpoint import make_csm_checkpoint
from voxtriton.models.families import load_family
from voxtriton.serving.reference_audio import read_reference_audio
from voxtriton.serving.voices import VoiceEncoder

pytestmark = pytest.mark.server

TEXT = "Good morning, this is the first voice."
CONTEXT_TEXT = "These are the words of the recording."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0)


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("csm-voices")


@pytest.fixture(scope="module")
def server(checkpoint, voices_dir):
    with start_server(checkpoint, parameters={"tts": {"voices_dir": str(voices_dir)}}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return TTSClient(server.grpc_url)


@pytest.fixture(scope="module")
def gateway(server, voices_dir):
    """No --checkpoint: the gateway reads the backend's checkpoint and lists the family's offer."""
    process, url = start_gateway(server.grpc_url, extra=("--voices-dir", str(voices_dir)))
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
        ("speaker", "ryan", "speaker: unknown voice 'ryan': not a speaker id"),
    ],
)
def test_fields_csm_does_not_take_are_refused_naming_them(server, client, field, value, message):
    error = raw_request(server.grpc_url, [string_input("text", "hi"), string_input(field, value)])
    assert error is not None and message in error, error
    assert speak(client, "still serving", seed=1, frames=3).completed


def test_an_input_stream_is_refused_naming_the_reason(client):
    synthesis = client.synthesize_text_stream(["Hello ", "there."], speaker="0", max_frames=4)
    assert synthesis.error is not None and "CSM reads its text whole" in synthesis.error
    error = client.synthesize("Hello.", speaker="0", max_frames=4, start_frames=4).error
    assert error is not None and "start_frames: CSM reads its text whole" in error, error
    assert speak(client, "still serving", seed=2, frames=3).completed


def test_the_gateway_lists_what_the_csm_model_offers_and_speaks_by_speaker_id(gateway):
    _, _, models = get(gateway, "/v1/models")
    offers = models["data"][0]["offers"]
    assert offers["family"] == "csm" and offers["codebooks"] == 32 and offers["sample_rate"] == 24000
    assert set(offers["fields"]) >= {"text", "speaker", "seed", "max_frames"}
    assert {"language", "instruct"} <= set(offers["refused"])
    assert {"reference_audio", "reference_text"} <= set(offers["fields"])
    assert not offers["input_streaming"] and offers["clones_voices"]
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


@pytest.fixture(scope="module")
def recording():
    """A 16 kHz WAV file (the server resamples it to 24 kHz) of a voiced-like test signal."""
    return audio_file(reference_audio(1.5, seed=3), rate=16000)


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return VoiceEncoder(load_family(checkpoint))


def in_process_codes(checkpoint, prompt, frames: int) -> np.ndarray:
    """The in-process engine's greedy codes (CPU, fp32, as the test server runs) for one prompt."""
    family = load_family(checkpoint)
    engine = Engine(family.new_runner(family.load_backbone(), 1, 512, 256), 1)
    params = GenerationParams.create(
        family.sampling, 1000, temperature=0.0, max_frames=frames, ignore_eos=True
    )
    return engine_codes(engine, [Request("expected", prompt, params)])["expected"][0].numpy()


def test_reference_audio_is_a_context_turn_with_the_in_process_engines_codes(
    client, checkpoint, encoder, recording
):
    """reference_audio + reference_text: a context turn spoken by `speaker` before the text. The
    streamed codes are the in-process engine's for the same conversation, and the audio their decode."""
    family = load_family(checkpoint)
    synthesis = speak(
        client,
        TEXT,
        seed=0,
        frames=8,
        temperature=0.0,
        reference_audio=recording,
        reference_text=CONTEXT_TEXT,
    )
    voice = encoder.encode([read_reference_audio(recording)], [CONTEXT_TEXT])[0]
    assert voice.codes.shape == (29, 32)  # 2.25 s at 12.5 Hz, one frame per started 80 ms
    expected = in_process_codes(checkpoint, family.prompt.prompt(TEXT, "1", voice), 8)
    np.testing.assert_array_equal(synthesis.codes, expected)
    assert not np.array_equal(speak(client, TEXT, seed=0, frames=8, temperature=0.0).codes, expected)
    mimi = family.load_codec()
    whole, _ = mimi.decode(
        torch.from_numpy(expected)[None], torch.zeros(1, dtype=torch.long), mimi.new_state(1)
    )
    assert np.abs(whole[0].numpy() - synthesis.audio).max() <= 1e-4


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(reference_audio="recording"), "reference_text: is required with reference_audio"),
        (dict(reference_text=CONTEXT_TEXT), "reference_text: given without reference_audio"),
        (dict(reference_audio=b"RIFF", reference_text=CONTEXT_TEXT), "reference_audio: not an audio file"),
        (dict(reference_audio="short", reference_text=CONTEXT_TEXT), "reference_audio: too short: 0.50 s"),
        (dict(reference_audio="silent", reference_text=CONTEXT_TEXT), "reference_audio: is silent"),
        (
            dict(reference_audio="recording", reference_text=CONTEXT_TEXT, speaker="anna"),
            "speaker: 'anna' is not a speaker id",
        ),
    ],
    ids=["no-text", "no-audio", "not-audio", "short", "silent", "named-speaker"],
)
def test_a_bad_reference_is_refused_naming_the_field(client, recording, options, message):
    files = {
        "recording": recording,
        "short": audio_file(reference_audio(0.5)),
        "silent": audio_file(np.zeros(24000, np.float32)),
    }
    options = {"speaker": "1", **options}
    if isinstance(options.get("reference_audio"), str):
        options["reference_audio"] = files[options["reference_audio"]]
    synthesis = client.synthesize("hi", seed=1, max_frames=3, **options)
    assert synthesis.error is not None and message in synthesis.error, synthesis.error
    assert speak(client, "still serving", seed=2, frames=3).completed


def test_the_gateway_registers_a_csm_voice_that_speaks_as_its_context_turn(
    gateway, client, checkpoint, encoder, recording
):
    """POST /v1/audio/voices encodes the recording once (codes and words); `speaker` (gRPC) or `voice`
    (OpenAI) naming it speaks with that context turn as speaker 0, with no re-encoding."""
    speakers = [{"name": "0", "speaker": True}, {"name": "1", "speaker": True}]
    code, _, listing = get(gateway, "/v1/audio/voices")
    assert code == 200 and listing == {"object": "list", "data": speakers}
    audio = base64.b64encode(recording).decode()
    for body, field, message in (
        ({"name": "anna", "audio": audio}, "text", "text: is required: CSM's voice is a context turn"),
        ({"name": "7", "audio": audio, "text": CONTEXT_TEXT}, "name", "'7' is a CSM speaker id"),
        ({"name": "anna", "audio": base64.b64encode(b"RIFF").decode(), "text": "Hi."}, "audio", "audio: not"),
    ):
        code, _, payload = post(gateway, body, "/v1/audio/voices")
        error = json.loads(payload)["error"]
        assert code == 400 and error["param"] == field and message in error["message"], error
    code, _, payload = post(
        gateway, {"name": "anna", "audio": audio, "text": CONTEXT_TEXT}, "/v1/audio/voices"
    )
    assert code == 201, payload
    described = json.loads(payload)
    assert described == {"name": "anna", "seconds": 2.32, "in_context": True, "text": CONTEXT_TEXT}
    assert get(gateway, "/v1/audio/voices")[2] == {"object": "list", "data": speakers + [described]}
    assert get(gateway, "/v1/models")[2]["data"][0]["voices"] == ["0", "1", "anna"]

    voice = encoder.encode([read_reference_audio(recording)], [CONTEXT_TEXT])[0]
    expected = in_process_codes(checkpoint, load_family(checkpoint).prompt.prompt(TEXT, 0, voice), 8)
    synthesis = client.synthesize(
        TEXT, speaker="anna", seed=0, max_frames=8, ignore_eos=True, codes=True, temperature=0.0
    ).raise_for_error()
    np.testing.assert_array_equal(synthesis.codes, expected)
    body = {"input": TEXT, "voice": "anna", "max_frames": 6, "ignore_eos": True, "response_format": "pcm"}
    code, _, pcm = post(gateway, body)
    assert code == 200 and len(pcm) == 6 * 1920 * 2

    code, _, payload = fetch(urllib.request.Request(f"{gateway}/v1/audio/voices/anna", method="DELETE"))
    assert code == 200 and json.loads(payload) == {"name": "anna", "deleted": True}
    synthesis = client.synthesize(TEXT, speaker="anna", max_frames=3)
    assert synthesis.error is not None
    assert "speaker: unknown voice 'anna': not a speaker id" in synthesis.error
    assert "nor a registered voice; registered: none" in synthesis.error
    assert get(gateway, "/v1/audio/voices")[2]["data"] == speakers


def test_the_playground_offers_csm_speaker_ids_and_hides_what_csm_does_not_take(gateway, browser):  # noqa: F811
    page = open_playground(browser, gateway, ignore_eos=True, seed=4)
    requests = []
    page.on("request", lambda r: requests.append(r.post_data_json) if r.method == "POST" else None)
    page.wait_for_function("document.getElementById('voice').options.length > 1")
    options = page.eval_on_selector_all("#voice option", "options => options.map(o => [o.value, o.text])")
    assert options == [["", "server default"], ["0", "speaker 0"], ["1", "speaker 1"]]
    # No instruction and no input streams for CSM: their controls are hidden; voices register.
    assert page.is_visible("#clone") and page.is_hidden("#instruct-control")
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
