"""The voices directory: safe names, limits, voices that outlive the process, edits seen at once."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from test_clone_parity import reference_audio
from test_clone_server import audio_file

from voxtriton.engine.encoder_runner import EncoderRunner
from voxtriton.errors import RequestError, ServerBusy
from voxtriton.models.config import load_config
from voxtriton.models.families import load_family
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.models.voice import Voice, codes_key
from voxtriton.serving.reference_audio import read_reference_audio
from voxtriton.serving.voices import EncodingQueue, VoiceEncoder, VoiceStore


@pytest.fixture(scope="module")
def family(tiny_base_checkpoint):
    return load_family(tiny_base_checkpoint)


def voice(seed: int, text: str | None = "Some words.") -> Voice:
    generator = np.random.default_rng(seed)
    return Voice(
        generator.standard_normal(64).astype(np.float32), generator.integers(0, 2048, (20, 16)), text
    )


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "A", "x" * 65, "naïve", "a b"])
def test_names_that_could_be_paths_are_refused(tmp_path, family, name):
    store = VoiceStore(tmp_path, family)
    with pytest.raises(RequestError, match="is not a voice name"):
        store.add(name, voice(0))
    with pytest.raises(RequestError, match="is not a voice name"):
        store.get(name)
    assert list(tmp_path.iterdir()) == []


def test_a_voice_outlives_its_store_and_a_change_is_seen_at_the_next_lookup(tmp_path, family):
    VoiceStore(tmp_path, family).add("anna", voice(1))
    reader = VoiceStore(tmp_path, family)  # another process, or the same after a restart
    first = reader.get("anna")
    np.testing.assert_array_equal(first.codes, voice(1).codes)
    assert first.text == "Some words." and reader.get("anna") is first  # cached
    path, old = tmp_path / "anna.npz", (tmp_path / "anna.npz").stat()
    VoiceStore(tmp_path, family).add("anna", voice(2), replace=True)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))  # replaced within the clock's resolution
    assert path.stat().st_size == old.st_size
    np.testing.assert_array_equal(reader.get("anna").embedding, voice(2).embedding)
    VoiceStore(tmp_path, family).add("anna", voice(3, None), replace=True)
    second = reader.get("anna")
    np.testing.assert_array_equal(second.embedding, voice(3).embedding)
    assert not second.in_context
    assert reader.delete("anna") and reader.get("anna") is None and not reader.delete("anna")
    assert "anna" not in reader.cache  # a deleted voice's entry goes at its next lookup


def test_the_voice_cache_keeps_at_most_max_voices(tmp_path, family):
    """Names registered, looked up and deleted (their next lookup never comes) do not pile up in
    the cache: it keeps the `max_voices` most recently used."""
    store = VoiceStore(tmp_path, family, max_voices=2)
    for number in range(5):
        store.add(f"v{number}", voice(number))
        store.get(f"v{number}")
        if number < 4:
            store.delete(f"v{number}")
    store.get("v4")
    assert list(store.cache) == ["v3", "v4"]


def test_limits_and_foreign_voices(tmp_path, family):
    store = VoiceStore(tmp_path, family, max_voices=2)
    store.add("one", voice(1))
    with pytest.raises(RequestError, match="exists"):
        store.add("one", voice(1))
    store.add("two", voice(2))
    with pytest.raises(RequestError, match="full"):
        store.add("three", voice(3))
    with pytest.raises(RequestError, match="not made for this checkpoint"):
        store.add("one", Voice(np.zeros(32, np.float32), voice(1).codes), replace=True)
    with pytest.raises(RequestError, match="name: voice 'one' has an x-vector that is not finite"):
        store.add("one", Voice(np.full(64, np.nan, np.float32), voice(1).codes), replace=True)
    (tmp_path / "broken.npz").write_bytes(b"not a voice")
    with pytest.raises(RequestError, match="speaker: registered voice 'broken' cannot be read"):
        store.get("broken")
    assert store.names() == ["broken", "one", "two"]


def test_a_shared_directory_lists_only_this_checkpoints_voices(tmp_path, family):
    """Checkpoints share the default voices directory: another's voice stays there, is not listed here,
    and naming it is an error, not a crash."""
    store = VoiceStore(tmp_path, family)
    store.add("mine", voice(1))
    theirs = Voice(np.zeros(32, np.float32), voice(2).codes, "Words.")  # another x-vector width
    np.savez(
        tmp_path / "theirs.npz",
        embedding=theirs.embedding,
        codes=theirs.codes.astype(np.int16),
        text=np.frombuffer(theirs.text.encode(), np.uint8),
    )
    assert store.names() == ["mine", "theirs"]
    assert [d["name"] for d in store.descriptions()] == ["mine"]
    with pytest.raises(RequestError, match="not made for this checkpoint"):
        store.get("theirs")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(), "reference_audio: is required by this Base model"),
        (dict(speaker="ryan", voice=voice(0)), "speaker: this Base model has no preset speakers"),
        (dict(instruct="Whisper.", voice=voice(0)), "instruct: not supported by Base checkpoints"),
    ],
    ids=["no-voice", "preset-speaker", "instruct"],
)
def test_base_prompts_need_a_voice_and_nothing_else(tiny_base_checkpoint, kwargs, message):
    builder = PromptBuilder(load_config(tiny_base_checkpoint), TextTokenizer(tiny_base_checkpoint))
    with pytest.raises(RequestError, match=message):
        builder.build("Hello.", **kwargs)


def test_a_voice_on_a_custom_voice_checkpoint_is_refused(tiny_checkpoint):
    builder = PromptBuilder(load_config(tiny_checkpoint), TextTokenizer(tiny_checkpoint))
    with pytest.raises(RequestError, match="reference_audio: voice cloning needs a Base checkpoint"):
        builder.build("Hello.", "ryan", voice=voice(0))


def test_the_encoding_queue_answers_every_request_once(tiny_base_checkpoint):
    answers: dict[str, list] = {}
    finished = threading.Semaphore(0)

    def answer(name, kind, value):
        answers.setdefault(name, []).append((kind, value))
        finished.release()

    def busy(voice):
        raise ServerBusy("server busy: full")

    queue = EncodingQueue(VoiceEncoder(load_family(tiny_base_checkpoint)))
    jobs = {
        "good": (audio_file(reference_audio(1.5)), lambda voice: answer("good", "voice", voice)),
        "not-audio": (b"nothing", lambda voice: answer("not-audio", "voice", voice)),
        "busy": (audio_file(reference_audio(1.2)), busy),
    }
    for name, (audio, done) in jobs.items():
        queue.submit(audio, "Words.", done, lambda message, name=name: answer(name, "error", message))
    for _ in jobs:
        assert finished.acquire(timeout=60)
    queue.shutdown()
    assert {name: len(values) for name, values in answers.items()} == {"good": 1, "not-audio": 1, "busy": 1}
    kind, voice = answers["good"][0]
    assert kind == "voice" and voice.in_context and voice.codes.shape == (19, 16)
    assert answers["not-audio"][0][1].startswith("reference_audio: not an audio file")
    assert answers["busy"][0] == ("error", "server busy: full")


def test_a_batch_of_recordings_gives_each_the_voice_it_gets_alone(tiny_base_checkpoint):
    """Recordings of two lengths (1.0 s ends mid-frame) in one batch: each gets its voice alone."""
    encoder = VoiceEncoder(load_family(tiny_base_checkpoint))
    audio = [reference_audio(1.0, seed=1), reference_audio(1.3, seed=2), reference_audio(1.0, seed=3)]
    texts = [None, "Words.", "Other words."]
    for wave, text, voice in zip(audio, texts, encoder.encode(audio, texts)):
        alone = encoder.encode([wave], [text])[0]
        assert alone.text == voice.text and voice.codes.shape == alone.codes.shape
        np.testing.assert_array_equal(voice.codes, alone.codes)
        # fp32 rounding of a batch of two against one
        assert np.abs(voice.embedding - alone.embedding).max() <= 1e-5 * np.abs(alone.embedding).max()
    # An inline x-vector voice skips the speech encoder: the first recording gets no codes, the
    # same x-vector, and its batch-mate the codes it gets alone.
    inline = encoder.encode(audio, texts, x_vector_codes=False)
    assert inline[0].codes.shape == (0, 16) and not inline[0].in_context
    np.testing.assert_allclose(inline[0].embedding, encoder.encode(audio[:1], [None])[0].embedding, rtol=1e-5)
    np.testing.assert_array_equal(inline[2].codes, encoder.encode(audio[2:], texts[2:])[0].codes)


def test_input_streams_take_x_vector_voices_only(tiny_base_checkpoint):
    """Text that streams in is laid out interleaved and may not have ended: an x-vector voice fits
    that prompt; an in-context one needs the whole text beside its reference codes."""
    builder = PromptBuilder(load_config(tiny_base_checkpoint), TextTokenizer(tiny_base_checkpoint))
    text_ids = builder.tokenizer.encode("Hello there")
    streamed = builder.head(voice=voice(0, None)).prompt(text_ids, interleaved=True, text_ended=False)
    assert streamed.speaker_embedding is not None and streamed.trailing_text_ids == text_ids[1:]
    with pytest.raises(RequestError, match="speaker: an in-context voice .* needs the whole text"):
        builder.head(voice=voice(0)).prompt(text_ids, interleaved=True, text_ended=False)


def test_the_voices_command_says_what_is_wrong_in_one_line(
    tmp_path, tiny_base_checkpoint, tiny_checkpoint, capsys
):
    from voxtriton.cli import main

    common = ["--voices-dir", str(tmp_path)]
    assert main(["voices", "list", "--checkpoint", str(tmp_path / "none"), *common]) == 2
    assert "--checkpoint: " in capsys.readouterr().err
    for action in (["list"], ["delete", "x"]):  # a checkpoint that clones no voice has none to list
        assert main(["voices", *action, "--checkpoint", str(tiny_checkpoint), *common]) == 2
        assert capsys.readouterr().err == (
            "voxtriton voices: checkpoint: is custom_voice; "
            "voices need a Qwen3-TTS Base or a CSM checkpoint\n"
        )
    theirs = voice(2)  # beside none of this checkpoint's: a readable one of another x-vector width
    np.savez(
        tmp_path / "theirs.npz",
        embedding=np.zeros(32, np.float32),
        codes=theirs.codes.astype(np.int16),
        text=np.frombuffer(theirs.text.encode(), np.uint8),
    )
    assert main(["voices", "list", "--checkpoint", str(tiny_base_checkpoint), *common]) == 0
    listed = capsys.readouterr()
    assert listed.out == "" and listed.err == (
        "voxtriton voices: left out theirs: voice 'theirs' was not made for this checkpoint "
        f"(x-vector or codes differ)\nvoxtriton voices: no registered voices in {tmp_path}\n"
    )
    recording = tmp_path / "recording.wav"
    recording.write_bytes(audio_file(reference_audio(1.5)))
    add = ["voices", "add", "--checkpoint", str(tiny_base_checkpoint), "--audio", str(recording), *common]
    # the directory holds `theirs` already
    assert main([*add, "first", "--max-voices", "2"]) == 0 and '"name": "first"' in capsys.readouterr().out
    assert main([*add, "second", "--max-voices", "2"]) == 2
    assert capsys.readouterr().err == "voxtriton voices: name: the voices directory is full (2 voices)\n"
    assert main([*add, "second", "--max-voices", "0"]) == 2
    assert capsys.readouterr().err == "voxtriton voices: --max-voices: must be at least 1, got 0\n"
    missing = str(tmp_path / "missing.wav")
    assert (
        main(["voices", "add", "x", "--checkpoint", str(tiny_base_checkpoint), "--audio", missing, *common])
        == 2
    )
    assert (
        capsys.readouterr().err
        == f"voxtriton voices: audio: cannot read {missing}: No such file or directory\n"
    )
    assert main([*add, "third", "--voices-dir", str(recording)]) == 2  # the last --voices-dir counts
    assert (
        capsys.readouterr().err == f"voxtriton voices: --voices-dir: {str(recording)!r} is not a directory\n"
    )
    assert main([*add, "first"]) == 2
    assert (
        capsys.readouterr().err
        == "voxtriton voices: name: voice 'first' exists; delete it first, or replace it\n"
    )


class CountingEncoder(VoiceEncoder):
    """A voice encoder that counts the recordings it encodes."""

    def __init__(self, family):
        super().__init__(family)
        self.encoded = 0

    def encode(self, waveforms, texts, x_vector_codes=True):
        self.encoded += len(waveforms)
        return super().encode(waveforms, texts, x_vector_codes)


@pytest.mark.parametrize("cache_size", [0, 2])
def test_the_encoding_queue_keeps_the_latest_references_voices(tiny_base_checkpoint, cache_size):
    """With a cache, a recording sent again with the same transcript is not encoded again and gets the
    same voice, an in-context one keyed by its codes (so its primed state is kept); another
    transcript is another voice; the least recently used goes first. Without one, every request
    encodes."""
    encoder = CountingEncoder(load_family(tiny_base_checkpoint))
    queue = EncodingQueue(encoder, cache_size=cache_size)
    recordings = [audio_file(reference_audio(1.5, seed=seed)) for seed in range(3)]

    def voice_of(audio, text):
        answers = []
        done = threading.Event()
        queue.submit(
            audio, text, lambda v: (answers.append(v), done.set()), lambda e: (answers.append(e), done.set())
        )
        assert done.wait(60) and isinstance(answers[0], Voice), answers
        return answers[0]

    try:
        first = voice_of(recordings[0], "Words.")
        again = voice_of(recordings[0], "Words.")
        x_vector = voice_of(recordings[0], None)
        if cache_size == 0:
            assert encoder.encoded == 3 and first.key is None and again.key is None
            return
        assert encoder.encoded == 2 and again is first and first.key == codes_key(first.codes)
        assert x_vector.key is None and not x_vector.in_context and len(x_vector.codes) == 0
        voice_of(recordings[1], "Words.")  # evicts the first in-context voice (least recently used)
        assert voice_of(recordings[0], None) is x_vector and encoder.encoded == 3
        voice_of(recordings[0], "Words.")
        assert encoder.encoded == 4
    finally:
        queue.shutdown()


def test_a_kept_voice_does_not_wait_for_the_encoding_of_its_pass(tiny_base_checkpoint):
    """A recording sent again is answered from the cache before the new recordings taken in the
    same pass are encoded."""

    class HeldEncoder(CountingEncoder):
        def __init__(self, family):
            super().__init__(family)
            self.hold, self.holding = threading.Event(), threading.Event()

        def encode(self, waveforms, texts, x_vector_codes=True):
            if self.encoded:  # the first recording encodes at once; then each pass waits
                self.holding.set()
                assert self.hold.wait(60)
            return super().encode(waveforms, texts, x_vector_codes)

    encoder = HeldEncoder(load_family(tiny_base_checkpoint))
    queue = EncodingQueue(encoder, cache_size=4)
    kept, new = (audio_file(reference_audio(1.5, seed=seed)) for seed in (5, 6))
    answered = {name: threading.Event() for name in ("kept", "again", "new")}

    def submit(audio, name):
        queue.submit(audio, "Words.", lambda voice: answered[name].set(), lambda error: None)

    try:
        submit(kept, "kept")
        assert answered["kept"].wait(60)
        with queue.lock:  # both in one pass: the encoder thread waits for this lock to take them
            submit(new, "new")
            submit(kept, "again")
        assert encoder.holding.wait(60)  # the new recording is being encoded...
        assert answered["again"].wait(60) and not answered["new"].is_set()  # ...the kept one is answered
        encoder.hold.set()
        assert answered["new"].wait(60) and encoder.encoded == 2
    finally:
        encoder.hold.set()
        queue.shutdown()


@pytest.fixture(scope="module")
def csm_family(tmp_path_factory):
    from voxtriton.models.csm.checkpoint import make_csm_checkpoint

    return load_family(make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0))


@pytest.mark.parametrize("which", ["family", "csm_family"])
def test_recordings_padded_to_a_bucket_get_the_codes_of_their_own_length(request, which):
    """The speech encoder runs at bucket shapes (the CUDA graphs' shapes): five recordings that end
    on, just before, just after and between frame boundaries, in batches of two, each row padded to
    the longest's bucket, get the codes the encoder gives each at its own length."""
    model = request.getfixturevalue(which).load_voice_encoders("cpu")[1]
    runner = EncoderRunner(model, lambda codes, samples: codes[: model.frames(samples)], graphs=False)
    frame = model.config.samples_per_frame
    lengths = [24 * frame, 24 * frame - 1, 24 * frame + 1, 13 * frame + 500, 31 * frame + 7]
    waves = [reference_audio(n / 24000, seed=n) for n in lengths]
    assert [len(wave) for wave in waves] == lengths
    with torch.inference_mode():
        padded = runner.run(waves)
        alone = [model(torch.from_numpy(wave)[None])[0] for wave in waves]
        # Without each row's length its strided layers would pad the bucket's end, not the row's.
        batch = torch.zeros(len(waves), next(n for n in runner.lengths if n >= max(lengths)))
        for row, wave in enumerate(waves):
            batch[row, : len(wave)] = torch.from_numpy(wave)
        unmasked = model(batch)
    for codes, own, wave in zip(padded, alone, waves):
        assert codes.shape == own.shape == (-(-len(wave) // frame), model.config.num_codes)
        torch.testing.assert_close(codes, own, rtol=0, atol=0)
    assert any(not torch.equal(unmasked[row, : len(own)], own) for row, own in enumerate(alone))


def test_recordings_padded_to_a_bucket_get_the_x_vector_of_their_own_length(family):
    """The speaker encoder at bucket shapes: each row's tail is its own end's reflection and the
    averages count its own frames, so a row gets its x-vector alone (fp32 rounding apart); a bucket
    leaves `tail_margin` samples after the longest row, without which the last frames would read
    the next row's zeros, not the reflection."""
    model = family.load_voice_encoders("cpu")[0]
    runner = EncoderRunner(model, lambda x_vector, _: x_vector, model.tail_margin, graphs=False)
    two_seconds = 2 * model.config.sample_rate
    lengths = [two_seconds, two_seconds + 1, two_seconds - 10, 24000, 61000]
    waves = [reference_audio(n / 24000, seed=n) for n in lengths]

    def error(x_vector: torch.Tensor, wave: np.ndarray) -> float:
        alone = model(torch.from_numpy(wave)[None])[0]
        return ((x_vector - alone).abs().max() / alone.abs().max()).item()

    with torch.inference_mode():
        assert max(error(x_vector, wave) for x_vector, wave in zip(runner.run(waves), waves)) <= 1e-5
        without_margin = EncoderRunner(model, lambda x_vector, _: x_vector, graphs=False)
        assert error(without_margin.run(waves[2:3])[0], waves[2]) > 1e-4
        batch = torch.zeros(1, runner.lengths[0])
        batch[0, : lengths[2]] = torch.from_numpy(waves[2])
        assert error(model(batch)[0], waves[2]) > 1e-2  # no lengths at all


def test_a_request_is_refused_naming_the_field_that_is_too_long(tmp_path, tiny_base_checkpoint):
    """Interleaved, an in-context voice's transcript leads the text it feeds frame by frame: a long
    transcript is refused as `reference_text`, a long text as `text`; an input stream naming an
    in-context voice is refused at its first piece, before any word settles."""
    from voxtriton.serving.requests import RequestParser
    from voxtriton.serving.settings import TTSSettings

    config = load_config(tiny_base_checkpoint)
    store = VoiceStore(tmp_path, load_family(tiny_base_checkpoint))
    store.add("ic", voice(1))
    settings = TTSSettings(text_layout="interleaved", max_text_tokens=40)
    parser = RequestParser(
        config, PromptBuilder(config, TextTokenizer(tiny_base_checkpoint)), settings, store
    )

    def inputs(text: str, **more) -> dict:
        return {
            name: np.array([value.encode()], dtype=object) for name, value in dict(text=text, **more).items()
        }

    short = voice(2, "A few words.")  # 20 reference frames
    assert parser.parse("a", inputs("Hello there."), short).prompt.reference_codes is not None
    with pytest.raises(RequestError, match="reference_text: too long: with the text, over 40 tokens"):
        parser.parse("b", inputs("Hello there."), voice(2, "word " * 80))
    with pytest.raises(RequestError, match="text: too long: more than 40 tokens"):
        parser.parse("c", inputs("word " * 50), short)
    with pytest.raises(RequestError, match="reference_text: too long: 4097 bytes"):
        parser.reference(
            {
                **inputs("Hi."),
                "reference_audio": np.array([b"RIFF"], dtype=object),
                "reference_text": np.array([b"x" * 4097], dtype=object),
            }
        )
    with pytest.raises(RequestError, match="speaker: an in-context voice .* needs the whole text"):
        parser.parse_stream(inputs("Hello", speaker="ic"))
    with pytest.raises(RequestError, match="speaker: unknown voice 'Anna Smith'; registered: ic"):
        parser.parse("d", inputs("Hello.", speaker="Anna Smith"))  # a name no voice can have


def encoded_file(audio: np.ndarray, rate: int, format: str, subtype: str = "PCM_16") -> bytes:
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, audio, rate, format=format, subtype=subtype)
    return buffer.getvalue()


def test_a_float_recording_far_beyond_full_scale_is_refused(family):
    """Its samples are finite, but the speaker encoder's spectrum overflows: a NaN x-vector would
    reach the prompt (and the KV row its stream leaves to the next)."""
    loud = reference_audio(1.5) * np.float32(1e20)
    assert np.isfinite(loud).all()
    with pytest.raises(
        RequestError, match="reference_audio: peak [0-9.]+e\\+[0-9]+ is far beyond full scale"
    ):
        read_reference_audio(encoded_file(loud, 24000, "WAV", "FLOAT"))
    hot = reference_audio(1.5) * np.float32(1.5 / np.abs(reference_audio(1.5)).max())  # +3.5 dBFS: taken
    (x_vector,) = VoiceEncoder(family).encode(
        [read_reference_audio(encoded_file(hot, 24000, "WAV", "FLOAT"))], [None]
    )
    assert np.isfinite(x_vector.embedding).all()


def test_a_flac_whose_header_gives_no_length_is_refused_for_that():
    """A streaming encoder (ffmpeg to a pipe) leaves STREAMINFO's total samples at 0, unknown."""
    raw = bytearray(encoded_file(reference_audio(2.0), 24000, "FLAC"))
    raw[21] &= 0xF0  # STREAMINFO's 36-bit total samples: its top 4 bits, then 4 bytes
    raw[22:26] = bytes(4)
    with pytest.raises(RequestError, match="reference_audio: its header gives no length"):
        read_reference_audio(bytes(raw))


def test_a_reference_file_is_checked_by_its_header_before_it_is_decoded():
    """A 60 s, 8-channel, 192 kHz FLAC of a constant (tens of KB) would decode to 350 MB of floats:
    its header's length refuses it first. Too many channels, and a rate that shares almost no factor
    with 24 kHz (a polyphase filter thousands of taps long), are refused likewise; a stereo 44.1 kHz
    recording is mixed down and resampled."""
    import tracemalloc

    bomb = encoded_file(np.full((60 * 192000, 8), 0.25, np.float32), 192000, "FLAC")
    assert len(bomb) < 1 << 20
    tracemalloc.start()
    with pytest.raises(RequestError, match=r"reference_audio: too long: 60.00 s \(at most 30 s\)"):
        read_reference_audio(bomb)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(bomb) + (16 << 20), peak  # nothing of its 350 MB was decoded
    many = encoded_file(np.full((24000, 9), 0.25, np.float32), 24000, "WAV")
    with pytest.raises(RequestError, match="reference_audio: 9 channels \\(at most 8"):
        read_reference_audio(many)
    odd = encoded_file(np.full(44101 * 2, 0.25, np.float32), 44101, "WAV")
    with pytest.raises(RequestError, match="sample rate 44101 Hz is not supported: use a common one"):
        read_reference_audio(odd)
    stereo = np.stack([reference_audio(2.0), np.zeros(48000, np.float32)], axis=1)
    stereo_44k = encoded_file(np.repeat(stereo, 2, axis=0)[: int(2.0 * 44100)], 44100, "WAV")
    assert read_reference_audio(stereo_44k).shape == (48000,)


def test_the_encoding_queue_refuses_beyond_its_limit_and_outlives_a_failing_answer(tiny_base_checkpoint):
    """More waiting recordings than `max_waiting`: server busy at once. A request whose answer and
    error both fail to send (its client's sender is broken) leaves the rest of its pass answered
    with their voices, and the thread goes on encoding."""
    queue = EncodingQueue(VoiceEncoder(load_family(tiny_base_checkpoint)), max_waiting=2)
    recordings = [audio_file(reference_audio(1.2, seed=seed)) for seed in range(3)]
    answers: dict[str, list] = {}
    answered = threading.Semaphore(0)

    def note(name):
        def record(value):
            answers.setdefault(name, []).append(value)
            answered.release()

        return record

    def broken(value):
        raise RuntimeError("a sender that fails")

    def refused(voice):
        raise RequestError("text", "is empty")

    try:
        with queue.lock:  # the encoder thread waits for this lock to take a pass
            queue.submit(recordings[0], None, refused, broken)
            queue.submit(recordings[1], None, note("second"), note("second"))
            with pytest.raises(ServerBusy, match="server busy: 2 requests with reference_audio wait"):
                queue.submit(recordings[2], None, note("third"), note("third"))
        assert answered.acquire(timeout=60) and isinstance(answers["second"][0], Voice)
        queue.submit(recordings[2], None, note("third"), note("third"))
        assert answered.acquire(timeout=60) and isinstance(answers["third"][0], Voice)
        # Recordings in the pass being encoded count too: two in it, none waiting, a third is refused.
        encode, started, release = queue.encoder.encode, threading.Event(), threading.Event()

        def held_encode(*args, **kwargs):
            started.set()
            release.wait(60)
            return encode(*args, **kwargs)

        queue.encoder.encode = held_encode
        with queue.lock:
            for name in ("fourth", "fifth"):
                queue.submit(audio_file(reference_audio(1.3, seed=len(name))), None, note(name), note(name))
        assert started.wait(60) and not queue.jobs
        with pytest.raises(
            ServerBusy,
            match="server busy: 2 requests with reference_audio wait for the voice encoder or are in it",
        ):
            queue.submit(recordings[0], None, note("sixth"), note("sixth"))
        release.set()
        assert answered.acquire(timeout=60) and answered.acquire(timeout=60)
    finally:
        queue.shutdown()
    with pytest.raises(ServerBusy, match="server shutting down"):
        queue.submit(recordings[0], None, note("late"), note("late"))


def test_a_name_taken_after_the_check_is_not_overwritten(tmp_path, family, monkeypatch):
    """Two registrations of one name at once (two gateways on one directory): the second to land is
    refused, not written over the first."""
    store = VoiceStore(tmp_path, family)
    real_exists = type(tmp_path).exists
    # The other registration lands between this one's check and its write.
    monkeypatch.setattr(
        type(tmp_path),
        "exists",
        lambda path: False if path.name == "anna.npz" else real_exists(path),
    )
    VoiceStore(tmp_path, family).add("anna", voice(1))
    with pytest.raises(RequestError, match="voice 'anna' exists"):
        store.add("anna", voice(2))
    np.testing.assert_array_equal(VoiceStore(tmp_path, family).get("anna").codes, voice(1).codes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anna.npz"]  # no temporary file left


def test_a_reference_just_short_of_a_second_is_not_reported_as_one():
    from voxtriton.serving.reference_audio import read_reference_audio

    recording = audio_file(reference_audio(1.0)[:23988])  # 0.9995 s
    with pytest.raises(RequestError, match=r"^reference_audio: too short: 0\.99 s \(at least 1 s\)$"):
        read_reference_audio(recording)
