"""The gateway's request checks and WAV header, without a server: each bad field named, in plain words."""

from __future__ import annotations

import io
import wave

import pytest
from voxtriton_client import Synthesis

from voxtriton.serving.audio_formats import streaming_wav_header
from voxtriton.serving.drain import SHUTTING_DOWN
from voxtriton.serving.gateway import (
    MODEL_ALIASES,
    REQUEST_FIELDS,
    BackendUnreachable,
    SpeechError,
    SpeechStream,
    close_code,
    cut_short,
    error_from_server,
    parse_speech_request,
    parse_text_piece,
    unreachable,
)

MAX_FRAMES_RANGE = "max_frames: must be between 1 and the server's max_frames (1500 unless set otherwise)"


def rejection(body) -> SpeechError:
    with pytest.raises(SpeechError) as caught:
        parse_speech_request(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("model", ["tts", *MODEL_ALIASES])
def test_the_served_model_and_openai_names_are_accepted(model):
    options = parse_speech_request({"model": model, "input": "hi", "voice": "Ryan"})
    assert options == {"format": "wav", "sse": False, "text": "hi", "speaker": "Ryan"}


def test_an_unknown_model_is_named_with_what_is_served():
    error = rejection({"model": "whisper-1", "input": "hi"})
    assert error.param == "model"
    assert error.message == (
        "model: unknown model 'whisper-1'; this gateway serves tts, tts-1, tts-1-hd, gpt-4o-mini-tts"
    )


def test_unknown_fields_are_named_all_at_once():
    error = rejection({"model": "tts", "input": "hi", "speeed": 1.0, "volume": 2})
    assert error.param == "speeed"
    assert error.message.startswith("speeed, volume: unknown fields; supported: model, input,")
    single = rejection({"input": "hi", "format": "wav"})
    assert single.message.startswith("format: unknown field; supported:")
    assert set(REQUEST_FIELDS) >= {"model", "input", "voice", "response_format", "speed", "instructions"}


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("seed", "7", "seed: must be an integer"),
        ("seed", True, "seed: must be an integer"),
        ("max_frames", 2.5, "max_frames: must be an integer"),
        (
            "max_frames",
            2**32 + 30,
            f"{MAX_FRAMES_RANGE}, got {2**32 + 30}",
        ),
        (
            "max_frames",
            -(2**40),
            f"{MAX_FRAMES_RANGE}, got {-(2**40)}",
        ),
        ("seed", 2**64, f"seed: must be between -9223372036854775808 and 9223372036854775807, got {2**64}"),
        ("ignore_eos", 1, "ignore_eos: must be true or false"),
        ("voice", 3, "voice: must be a string"),
        ("stream_format", "chunks", "stream_format: 'chunks' is not one of audio, sse"),
        ("response_format", "aac", "response_format: 'aac' is not supported (use wav, pcm, opus, mp3)"),
        ("response_format", ["wav"], "response_format: ['wav'] is not supported (use wav, pcm, opus, mp3)"),
        ("voice", "ry\ud800an", "voice: not valid Unicode (a lone surrogate at character 2)"),
        ("instructions", "\udfff", "instructions: not valid Unicode (a lone surrogate at character 0)"),
        ("speed", 2, "speed: only 1.0 is supported (the model has no speed control)"),
        ("speed", True, "speed: only 1.0 is supported (the model has no speed control)"),
    ],
)
def test_bad_values_are_named_in_plain_words(field, value, message):
    error = rejection({"input": "hi", field: value})
    assert (error.param, error.message) == (field, message)


def test_sse_with_voxtriton_fields():
    options = parse_speech_request(
        {"input": "hi", "stream_format": "sse", "response_format": "pcm", "max_frames": 30, "seed": 4}
    )
    assert options == {"format": "pcm", "sse": True, "text": "hi", "max_frames": 30, "seed": 4}


def test_server_errors_become_short_sentences():
    busy = error_from_server(
        "server busy: 2 streams generating or queued (max_streams 1 + max_queued 0); retry"
    )
    assert (busy.status, busy.kind, busy.message) == (
        503,
        "server_busy",
        "The voxtriton server is busy; retry shortly.",
    )
    stopping = error_from_server(SHUTTING_DOWN)
    assert (stopping.status, stopping.kind) == (503, "shutting_down")
    loading = error_from_server("Request for unknown model: 'tts' has no available versions")
    assert (loading.status, loading.kind) == (503, "service_unavailable")
    field = error_from_server("text: too long: more than 512 tokens")
    assert (field.status, field.param, field.message) == (
        400,
        "input",
        "input: too long: more than 512 tokens",
    )
    internal = error_from_server("internal error: CUDA error: an illegal memory access\nTraceback ...")
    assert internal.status == 502 and "\n" not in internal.message and "CUDA" not in internal.message


def test_how_a_stream_ended_becomes_the_callers_error():
    assert SpeechStream.ending(Synthesis(completed=True)) is None  # no audio, but no error either
    early = SpeechStream.ending(Synthesis(completed=False))  # no final response: the server went away
    assert (early.status, early.message) == (502, "The voxtriton server stopped answering mid-request.")
    dropped = SpeechStream.ending(ConnectionResetError("Socket closed"))
    assert (dropped.status, dropped.message) == (early.status, early.message)
    down = SpeechStream.ending(BackendUnreachable("127.0.0.1:1"))
    assert (down.status, down.kind) == (503, "service_unavailable")
    assert down.message == "No voxtriton server is ready; retry when one is up."
    assert SpeechStream.ending(Synthesis(error="seed: must be >= 0")).param == "seed"


def test_the_streamed_wav_header_is_standard_with_open_ended_sizes():
    header = streaming_wav_header()
    assert len(header) == 44 and header[4:8] == b"\xff\xff\xff\xff" and header[40:44] == b"\xff\xff\xff\xff"
    with wave.open(io.BytesIO(header)) as parsed:
        assert (parsed.getframerate(), parsed.getnchannels(), parsed.getsampwidth()) == (24000, 1, 2)


def test_text_with_no_utf8_form_is_named_in_a_request_and_in_a_text_stream():
    """A lone surrogate (JSON's "\\ud800") has no UTF-8: refused as the field's error (it reached
    the gRPC client's encoding, and came back as a 502 blaming the server)."""
    error = rejection({"input": "Hello \ud800"})
    assert (error.param, error.message) == (
        "input",
        "input: not valid Unicode (a lone surrogate at character 6)",
    )
    for first in (True, False):
        with pytest.raises(SpeechError) as caught:
            parse_text_piece({"input": "\udc80 there"}, first)
        assert (caught.value.status, caught.value.param) == (400, "input")


def test_a_text_streams_start_frames_past_any_schedule_is_its_largest_and_below_one_is_refused():
    """An int32 cannot hold 2**40: the server would get a wrapped value. Any start_frames above the
    chunk schedule's largest size means that size, so the gateway sends the largest it can."""
    _, _, options = parse_text_piece({"input": "Hi", "start_frames": 2**40}, first=True)
    assert options["start_frames"] == 2**31 - 1
    with pytest.raises(SpeechError) as caught:
        parse_text_piece({"input": "Hi", "start_frames": -(2**40)}, first=True)
    assert (caught.value.param, caught.value.message) == (
        "start_frames",
        f"start_frames: must be at least 1, got {-(2**40)}",
    )


def test_a_text_streams_close_code_says_whether_to_retry():
    assert close_code(None) == close_code(rejection({"input": ""})) == 1000
    assert close_code(error_from_server("server busy: 2 streams; retry")) == 1013
    assert close_code(error_from_server(SHUTTING_DOWN)) == close_code(unreachable()) == 1013
    assert close_code(cut_short()) == close_code(error_from_server("internal error: boom")) == 1011


def test_a_text_streams_errors_name_the_stream_not_the_gateways_sequence_id():
    sequence = "'" + "f2e83c66" * 4 + "'"
    empty = error_from_server(f"text: sequence {sequence}: the text is empty")
    assert (empty.param, empty.message) == ("input", "input: the text stream: the text is empty")
    idle = error_from_server(f"text: sequence {sequence} had no text piece for 10 s (text_idle_timeout_s)")
    assert idle.message == "input: the text stream had no text piece for 10 s (text_idle_timeout_s)"


def test_a_stream_the_gateway_stopped_ends_without_a_warning(caplog):
    """A caller that leaves is routine: its stream's end is not logged as a failure, as a dropped
    connection to the server is."""
    from voxtriton.serving.gateway import StreamCancelled

    with caplog.at_level("WARNING", logger="voxtriton.gateway"):
        assert SpeechStream.ending(StreamCancelled("stream cancelled")).status == 502
        assert caplog.records == []
        SpeechStream.ending(ConnectionResetError("Socket closed"))
    assert [r.getMessage() for r in caplog.records] == [
        "voxtriton stream failed: ConnectionResetError('Socket closed')"
    ]
