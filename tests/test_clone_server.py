"""Voice cloning through a real tritonserver over gRPC (random tiny-base checkpoint: noise, not speech).

Reference recordings go in as file bytes (`reference_audio`); registered voices are named in
`speaker`. The streamed audio of an in-context clone must equal the offline decode of the reference
codes followed by the generated codes, with the reference part cut off.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import shlex
import subprocess
import time

import numpy as np
import pytest
import soundfile
import torch
import tritonclient.grpc as grpcclient
from server_helpers import start_server
from test_clone_parity import reference_audio
from test_server import raw_request, typed
from voxtriton_client import TTSClient
from voxtriton_client.api import request_inputs

from voxtriton.bench.server_metrics import codec_primings
from voxtriton.launch.serve import first_request_hint
from voxtriton.models.families import load_family
from voxtriton.models.loader import load_codec
from voxtriton.serving.reference_audio import read_reference_audio
from voxtriton.serving.voices import VoiceEncoder, VoiceStore

pytestmark = pytest.mark.server

TEXT = "A cloned voice speaks this sentence."
REFERENCE_TEXT = "The words of the reference recording."


def audio_file(audio: np.ndarray, rate: int = 24000, format: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate, format=format, subtype="PCM_16")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def server(tiny_base_checkpoint, voices_dir):
    with start_server(tiny_base_checkpoint, parameters={"tts": {"voices_dir": str(voices_dir)}}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return TTSClient(server.grpc_url)


@pytest.fixture(scope="module")
def encoder(tiny_base_checkpoint):
    return VoiceEncoder(load_family(tiny_base_checkpoint))


def clone(client, frames=24, **options):
    return client.synthesize(
        TEXT, seed=3, max_frames=frames, ignore_eos=True, codes=True, info=True, **options
    )


def test_in_context_clone_streams_the_audio_that_follows_the_reference(client, encoder, tiny_base_checkpoint):
    recording = audio_file(reference_audio(2.0), format="FLAC")
    synthesis = clone(client, reference_audio=recording, reference_text=REFERENCE_TEXT).raise_for_error()
    assert synthesis.codes.shape == (24, 16) and len(synthesis.chunks) >= 3
    voice = encoder.encode([read_reference_audio(recording)], [REFERENCE_TEXT])[0]
    codec = load_codec(tiny_base_checkpoint)
    whole = np.concatenate([voice.codes, synthesis.codes.astype(np.int64)])
    wav, _ = codec.decode(torch.from_numpy(whole)[None], torch.zeros(1, dtype=torch.long), codec.new_state(1))
    expected = wav[0, len(voice.codes) * 1920 :].numpy()
    assert np.abs(expected).max() > 0.05
    assert np.abs(synthesis.audio - expected).max() <= 1e-4


def test_any_sample_rate_and_channels(client):
    stereo = np.stack([reference_audio(1.5, seed=4)] * 2, axis=1)
    resampled = audio_file(stereo[::2], rate=12000)
    at_44k = audio_file(np.repeat(reference_audio(1.5, seed=4), 2)[:66150], rate=44100)
    for recording in (resampled, at_44k):
        synthesis = clone(client, frames=8, reference_audio=recording).raise_for_error()
        assert synthesis.codes.shape == (8, 16) and np.abs(synthesis.audio).max() > 0.01


def test_a_registered_voice_equals_its_inline_reference(client, encoder, voices_dir, tiny_base_checkpoint):
    recording = audio_file(reference_audio(2.0, seed=7))
    inline = clone(client, reference_audio=recording, reference_text=REFERENCE_TEXT).raise_for_error()
    unknown = clone(client, speaker="alice")
    assert unknown.error and "speaker" in unknown.error and "alice" in unknown.error
    store = VoiceStore(voices_dir, load_family(tiny_base_checkpoint))
    store.add("alice", encoder.encode([read_reference_audio(recording)], [REFERENCE_TEXT])[0])
    registered = clone(client, speaker="alice").raise_for_error()  # seen while the server runs
    np.testing.assert_array_equal(registered.codes, inline.codes)
    np.testing.assert_array_equal(registered.audio, inline.audio)
    assert store.delete("alice")
    assert "unknown voice 'alice'" in clone(client, speaker="alice").error


def primings_after(server, before: dict[str, float], decoded: int, reused: int) -> dict[str, float]:
    """Waits (metrics are written within 0.1 s) until the counts grew by `decoded` and `reused`."""
    expected = {"decoded": before["decoded"] + decoded, "reused": before["reused"] + reused}
    deadline = time.monotonic() + 10
    while (counts := codec_primings(server.metrics())) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts == expected, (counts, expected)
    return counts


def test_an_inline_references_encoding_counts_in_its_ttfa(server, client):
    """The server's TTFA of a request that brings `reference_audio` runs from its arrival, as the
    client's does: both hold the encoding (`voxtriton_reference_encoding_seconds`), so they differ
    by far less than it (a long in-context recording: hundreds of ms to encode on a CPU)."""
    names = ("voxtriton_reference_encoding_seconds", "voxtriton_ttfa_seconds")
    before = server.metrics()
    recording = audio_file(reference_audio(25.0, seed=11))
    synthesis = clone(client, frames=4, reference_audio=recording, reference_text=REFERENCE_TEXT)
    synthesis.raise_for_error()
    deadline = time.monotonic() + 10
    while True:  # metrics are written within 0.1 s
        after = server.metrics()
        counts = [after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0) for name in names]
        if counts == [1, 1] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counts == [1, 1]
    encoded, ttfa = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0) for name in names)
    assert 0 < encoded <= ttfa <= synthesis.playback.ttfa_s
    assert synthesis.playback.ttfa_s - ttfa < encoded / 2, (synthesis.playback.ttfa_s, ttfa, encoded)


def test_a_voice_is_primed_once_and_its_state_reused(
    server, client, encoder, voices_dir, tiny_base_checkpoint
):
    """An inline in-context reference primes with a codec call at its first stream; sent again, it is
    known by its bytes (`reference_cache`) and starts from the kept state, as does the same recording
    registered (the same codes): the same samples every time. A recording with other codes primes."""
    recording = audio_file(reference_audio(2.5, seed=11))
    before = codec_primings(server.metrics())
    inline = [clone(client, reference_audio=recording, reference_text=REFERENCE_TEXT) for _ in range(2)]
    counts = primings_after(server, before, decoded=1, reused=1)
    store = VoiceStore(voices_dir, load_family(tiny_base_checkpoint))
    store.add("bob", encoder.encode([read_reference_audio(recording)], [REFERENCE_TEXT])[0])
    registered = [clone(client, speaker="bob").raise_for_error() for _ in range(2)]
    counts = primings_after(server, counts, decoded=0, reused=2)
    for synthesis in inline[1:] + registered:
        np.testing.assert_array_equal(synthesis.codes, inline[0].raise_for_error().codes)
        np.testing.assert_array_equal(synthesis.audio, inline[0].audio)
    # Replaced by another recording: other codes, so its state is primed afresh.
    other = encoder.encode(
        [read_reference_audio(audio_file(reference_audio(1.5, seed=12)))], [REFERENCE_TEXT]
    )
    store.add("bob", other[0], replace=True)
    clone(client, speaker="bob").raise_for_error()
    primings_after(server, counts, decoded=1, reused=0)
    assert store.delete("bob")


def test_registered_voices_are_primed_before_ready_newest_first(encoder, tiny_base_checkpoint, tmp_path):
    """A server started on registered voices primes the newest in-context ones on every lane before it
    reports ready, as many as `primed_voices` keeps (2 states, 2 lanes: one voice), so that voice's
    first stream makes no codec call before its audio; an older one primes at its first stream."""
    store = VoiceStore(tmp_path, load_family(tiny_base_checkpoint))
    recordings = {
        name: audio_file(reference_audio(2.0, seed=seed)) for name, seed in (("old", 21), ("new", 22))
    }
    for age, name in enumerate(("new", "old")):
        store.add(name, encoder.encode([read_reference_audio(recordings[name])], [REFERENCE_TEXT])[0])
        os.utime(tmp_path / f"{name}.npz", ns=(10**18 - age * 10**9,) * 2)
    store.add("plain", encoder.encode([read_reference_audio(recordings["old"])], [None])[0])  # x-vector only
    os.utime(tmp_path / "plain.npz", ns=(2 * 10**18,) * 2)  # newest, but with nothing to prime
    parameters = {"tts": {"voices_dir": str(tmp_path), "primed_voices": "2"}}
    with start_server(tiny_base_checkpoint, parameters=parameters) as restarted:
        client = TTSClient(restarted.grpc_url)
        assert codec_primings(restarted.metrics()) == {
            "decoded": 0,
            "reused": 0,
        }  # the warm-up's are not counted
        first = clone(client, speaker="new").raise_for_error()
        counts = primings_after(restarted, {"decoded": 0, "reused": 0}, decoded=0, reused=1)
        clone(client, speaker="old").raise_for_error()
        primings_after(restarted, counts, decoded=1, reused=0)
        clone(client, speaker="plain").raise_for_error()
        inline = clone(client, reference_audio=recordings["new"], reference_text=REFERENCE_TEXT)
    np.testing.assert_array_equal(first.codes, inline.raise_for_error().codes)
    np.testing.assert_array_equal(first.audio, inline.audio)


@pytest.mark.parametrize(
    "options,message",
    [
        (
            dict(reference_audio=b"RIFF\x00\x00not audio at all"),
            "reference_audio: not an audio file that can be read (WAV, FLAC, OGG, MP3, ...): "
            "Format not recognised",
        ),
        (dict(reference_audio=audio_file(reference_audio(0.5))), "reference_audio: too short: 0.50 s"),
        (dict(reference_audio=audio_file(reference_audio(31.0))), "reference_audio: too long: 31.00 s"),
        (dict(reference_audio=audio_file(np.zeros(48000, np.float32))), "reference_audio: is silent"),
        (dict(reference_text=REFERENCE_TEXT), "reference_text: given without reference_audio"),
        (
            dict(reference_audio=audio_file(reference_audio(1.0)), speaker="alice"),
            "speaker: give a registered voice or reference_audio, not both",
        ),
        (dict(), "reference_audio: is required by this Base model"),
    ],
    ids=["not-audio", "too-short", "too-long", "silent", "text-without-audio", "both", "no-voice"],
)
def test_bad_references_are_refused_naming_the_field(client, options, message):
    synthesis = clone(client, frames=4, **options)
    assert synthesis.error is not None and message in synthesis.error
    assert clone(client, frames=4, reference_audio=audio_file(reference_audio(1.0))).error is None


def test_a_whole_text_requests_own_mistakes_are_refused_before_its_reference_is_encoded(server, client):
    """An empty text or an input stream's `start_frames` with a reference recording: refused naming
    the field, and the recording is not encoded for nothing (only the good request after them is)."""
    name = "voxtriton_reference_encoding_seconds_count"
    before = server.metrics().get(name, 0)
    recording = audio_file(reference_audio(1.0, seed=31))
    reference = typed("reference_audio", np.array([recording], dtype=object), "BYTES")
    for inputs, message in (
        (request_inputs(grpcclient, " ", max_frames=4), "text: is empty"),
        (request_inputs(grpcclient, TEXT, max_frames=4, start_frames=4), "start_frames: only an input"),
    ):
        error = raw_request(server.grpc_url, inputs + [reference])
        assert error is not None and message in error, error
    assert clone(client, frames=4, reference_audio=recording).error is None
    deadline = time.monotonic() + 10
    while (count := server.metrics().get(name, 0)) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)  # metrics are written within 0.1 s: a count for the refused ones would be in
    assert server.metrics().get(name, 0) == before + 1, count


def test_reference_audio_of_the_wrong_type_is_refused(server, client):
    wrong = typed("reference_audio", np.zeros(1, np.float32), "FP32")
    error = raw_request(server.grpc_url, request_inputs(grpcclient, TEXT, max_frames=4) + [wrong])
    assert error is not None and "reference_audio" in error, error
    assert clone(client, frames=4, reference_audio=audio_file(reference_audio(1.0))).error is None


def test_concurrent_clones_match_their_solo_runs(client):
    """Recordings that arrive together are encoded together and their streams share codec calls,
    each primed with its own reference: nothing changes any one of them."""
    recordings = [audio_file(reference_audio(1.0 + 0.4 * i, seed=20 + i)) for i in range(4)]

    def run(i):
        text = REFERENCE_TEXT if i % 2 else None
        return clone(client, frames=12 + 2 * i, reference_audio=recordings[i], reference_text=text)

    solo = [run(i).raise_for_error() for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = [synthesis.raise_for_error() for synthesis in pool.map(run, range(4))]
    for alone, shared in zip(solo, together):
        np.testing.assert_array_equal(shared.codes, alone.codes)
        assert np.abs(shared.audio - alone.audio).max() <= 1e-4


def test_the_ready_hint_of_a_base_checkpoint_registers_a_voice_and_speaks_in_it(
    server, tiny_base_checkpoint, voices_dir, tmp_path
):
    """`voxtriton serve` prints this hint once ready: both of its commands, run as printed (a reference
    recording in place of REFERENCE.wav), register a voice where the server reads voices and speak."""
    hint = first_request_hint(
        str(tiny_base_checkpoint), server.grpc_url, {"tts": {"voices_dir": str(voices_dir)}}
    )
    register, speak = (line.split(": ", 1)[1] for line in hint.splitlines())
    reference = tmp_path / "reference.wav"
    reference.write_bytes(audio_file(reference_audio(2.0, seed=9)))
    output = tmp_path / "hello.wav"
    for command in (
        register.replace("REFERENCE.wav", str(reference)),
        speak.replace("hello.wav", str(output)),
    ):
        done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    audio, rate = soundfile.read(output)
    assert rate == 24000 and len(audio) == 50 * 1920
    assert (voices_dir / "anna.npz").is_file()  # where the server reads voices from


def test_the_cli_clones_the_voice_of_a_recording_file(server, client, tmp_path, capsys):
    from voxtriton_client import cli

    recording = audio_file(reference_audio(1.5, seed=11))
    (tmp_path / "reference.wav").write_bytes(recording)
    out = tmp_path / "out.wav"
    options = ["--seed", "3", "--max-frames", "12", "--reference-text", REFERENCE_TEXT]
    arguments = ["speak", TEXT, "-o", str(out), "--server", server.grpc_url, *options]
    assert cli.main([*arguments, "--reference-audio", str(tmp_path / "reference.wav")]) == 0
    assert "TTFA" in capsys.readouterr().out
    expected = client.synthesize(
        TEXT, seed=3, max_frames=12, reference_audio=recording, reference_text=REFERENCE_TEXT
    ).raise_for_error()
    written, rate = soundfile.read(out, dtype="float32")
    assert rate == 24000 and len(written) == len(expected.audio) > 0
    assert np.abs(written - expected.audio).max() <= 1.5 / 32767  # 16-bit PCM
