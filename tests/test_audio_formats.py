"""The gateway's response formats, chunk by chunk, read back with libsndfile."""

from __future__ import annotations

import gc
import io
import sys

import numpy as np
import soundfile

from voxtriton.serving.audio_formats import SAMPLE_RATE, OpusEncoder, new_encoder, pcm16, streaming_wav_header

FRAME = 1920  # samples per codec frame at 12.5 Hz


def speech_like(frames: int) -> np.ndarray:
    t = np.arange(frames * FRAME) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def chunks_of(audio: np.ndarray, frames=(2, 2, 4, 8, 16)) -> list[np.ndarray]:
    edges = np.cumsum(frames)[:-1] * FRAME
    return np.split(audio, edges)


def test_opus_streams_every_chunk_as_it_comes_and_decodes_to_the_whole_audio():
    audio = speech_like(32)
    encoder = new_encoder("opus")
    assert encoder.start() == b""
    pieces = [encoder.encode(chunk) for chunk in chunks_of(audio)]
    tail = encoder.finish()
    # Every chunk's audio leaves with it (pages close every 20 ms), not a second later.
    assert all(len(piece) > 0 for piece in pieces), [len(p) for p in pieces]
    stream = b"".join(pieces) + tail
    assert stream[:4] == b"OggS"
    with soundfile.SoundFile(io.BytesIO(stream)) as decoded:
        assert (decoded.samplerate, decoded.channels, decoded.frames) == (SAMPLE_RATE, 1, len(audio))
        samples = decoded.read(dtype="float32")
    assert np.corrcoef(samples, audio)[0, 1] > 0.98
    assert len(stream) < len(pcm16(audio)) / 5


def test_pcm_and_wav_encode_in_place_and_the_wav_header_leads_once():
    audio = speech_like(4)
    wav = new_encoder("wav")
    assert not wav.blocking and wav.start() == streaming_wav_header() and wav.start() == b""
    assert wav.encode(audio) == pcm16(audio) and wav.finish() == b""
    sse_wav = new_encoder("wav")  # without start(): the header leads the first chunk
    assert sse_wav.encode(audio[:FRAME]) == streaming_wav_header() + pcm16(audio[:FRAME])
    assert sse_wav.encode(audio[FRAME:]) == pcm16(audio[FRAME:])
    pcm = new_encoder("pcm")
    assert pcm.start() == b"" and pcm.encode(audio) == pcm16(audio)


def test_mp3_streams_every_chunk_and_decodes_to_the_audio_after_the_encoders_delay():
    audio = speech_like(32)
    encoder = new_encoder("mp3")
    pieces = [encoder.encode(chunk) for chunk in chunks_of(audio)]
    tail = encoder.finish()
    assert all(len(piece) > 0 for piece in pieces), [len(p) for p in pieces]
    stream = b"".join(pieces) + tail
    samples, rate = soundfile.read(io.BytesIO(stream), dtype="float32")
    # No LAME tag in a stream: the decoder keeps the encoder's delay, and its own delay holds back
    # the last few milliseconds.
    delay = int(np.argmax(np.correlate(samples[: 2 * FRAME], audio[:FRAME], "valid")))
    kept = len(samples) - delay
    assert rate == SAMPLE_RATE and delay < 0.1 * SAMPLE_RATE and len(audio) - 0.03 * SAMPLE_RATE < kept
    assert np.corrcoef(samples[delay:], audio[:kept])[0, 1] > 0.95
    assert len(stream) < len(pcm16(audio)) / 5


def test_an_abandoned_opus_encoder_is_collected_without_an_error(monkeypatch):
    """A stream that ended early leaves its encoder unfinished, possibly in a reference cycle with
    the SoundFile and its buffer: the collector may finalise the buffer first, and libsndfile's last
    page must still have somewhere to go."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    encoder = OpusEncoder()
    encoder.encode(np.zeros(SAMPLE_RATE, np.float32))
    encoder.cycle = encoder
    del encoder
    gc.collect()
    assert unraisable == []
