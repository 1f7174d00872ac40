"""The gateway's response formats: each turns a stream's float chunks (24 kHz mono) into bytes as
they arrive, so the first audio leaves with the first chunk.

- `pcm`: 16-bit little-endian samples, as the OpenAI API defines it;
- `wav`: the same behind a header of unknown length;
- `opus`: Ogg Opus (libsndfile's encoder, about a tenth of pcm's bytes), the format browsers and
  voice apps stream. Ogg pages are closed every OPUS_PAGE_MS of audio instead of about every second,
  so each chunk's encoded audio is out as soon as the chunk is.
- `mp3`: MPEG-2 Layer III at MP3_KBPS, constant bit rate (LAME, through lameenc), OpenAI's default
  format. A stream carries no LAME tag (it is written at the end, which a stream cannot revisit), so
  decoders keep the encoder's delay (under 0.1 s of silence before the audio) and may hold back the
  last few milliseconds.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile

SAMPLE_RATE = 24000
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "opus": "audio/ogg", "mp3": "audio/mpeg"}
OPUS_PAGE_MS = 20.0
MP3_KBPS = 64
# libsndfile's SFC_SET_OGG_PAGE_LATENCY_MS (sndfile.h); soundfile has no wrapper for it
_SET_OGG_PAGE_LATENCY_MS = 0x1302


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def streaming_wav_header() -> bytes:
    """A WAV header for a stream of unknown length (sizes set to the maximum, as streaming servers do)."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


class PcmEncoder:
    """`pcm`, or `wav` with `header`: cheap enough to run on the event loop."""

    blocking = False

    def __init__(self, header: bytes = b""):
        self.header = header

    def start(self) -> bytes:
        """What may go out before the first chunk (the WAV header); else it leads the first chunk."""
        header, self.header = self.header, b""
        return header

    def encode(self, audio: np.ndarray) -> bytes:
        return self.start() + pcm16(audio)

    def finish(self) -> bytes:
        return b""


class _OggBuffer(io.BytesIO):
    """The encoder's output. An abandoned encoder is collected with its SoundFile, in any order: the
    buffer must not close itself first, as libsndfile writes its last page when the SoundFile goes."""

    def __del__(self):
        pass


class OpusEncoder:
    """Ogg Opus through libsndfile, writing into memory; `encode` returns what a chunk added.
    libsndfile releases the GIL while it encodes (a few ms per second of audio), so the gateway runs
    it on a worker thread (`blocking`)."""

    blocking = True

    def __init__(self):
        self.buffer = _OggBuffer()
        self.sent = 0
        self.file = soundfile.SoundFile(
            self.buffer, mode="w", samplerate=SAMPLE_RATE, channels=1, format="OGG", subtype="OPUS"
        )
        latency = soundfile._ffi.new("double*", OPUS_PAGE_MS)
        if soundfile._snd.sf_command(self.file._file, _SET_OGG_PAGE_LATENCY_MS, latency, 8) != 0:
            raise RuntimeError("libsndfile refused the Ogg page latency: opus cannot stream")

    def start(self) -> bytes:
        return b""  # libsndfile writes the Ogg headers with the first audio

    def encode(self, audio: np.ndarray) -> bytes:
        self.file.write(np.asarray(audio, dtype=np.float32))
        return self._new_bytes()

    def finish(self) -> bytes:
        """The last page (the end of the stream)."""
        self.file.close()
        return self._new_bytes()

    def _new_bytes(self) -> bytes:
        data = self.buffer.getbuffer()[self.sent :].tobytes()
        self.sent += len(data)
        return data


class Mp3Encoder:
    """LAME, fed 16-bit samples; `encode` returns the frames a chunk completed (LAME keeps up to about
    a frame, 48 ms, until the next chunk or `finish`)."""

    blocking = True

    def __init__(self):
        import lameenc  # the gateway extra

        self.lame = lameenc.Encoder()
        self.lame.set_in_sample_rate(SAMPLE_RATE)
        self.lame.set_channels(1)
        self.lame.set_bit_rate(MP3_KBPS)
        self.lame.set_quality(5)  # LAME's default speed and quality trade

    def start(self) -> bytes:
        return b""

    def encode(self, audio: np.ndarray) -> bytes:
        return bytes(self.lame.encode(pcm16(audio)))

    def finish(self) -> bytes:
        return bytes(self.lame.flush())


ENCODERS = {"opus": OpusEncoder, "mp3": Mp3Encoder}


def new_encoder(response_format: str) -> PcmEncoder | OpusEncoder | Mp3Encoder:
    if response_format in ENCODERS:
        return ENCODERS[response_format]()
    return PcmEncoder(streaming_wav_header() if response_format == "wav" else b"")


def check_encoders() -> None:
    """Every format's encoder starts and ends a stream: a broken install fails the gateway's start
    instead of the requests that ask for that format."""
    for name in MEDIA_TYPES:
        try:
            encoder = new_encoder(name)
            encoder.encode(np.zeros(SAMPLE_RATE // 10, np.float32))
            encoder.finish()
        except Exception as error:
            raise RuntimeError(f"response_format {name!r}: its encoder does not work ({error})") from error
