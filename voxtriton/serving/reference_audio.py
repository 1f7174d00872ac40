"""Reference recordings for voice cloning: file bytes -> a checked mono waveform at 24 kHz.

Any format libsndfile reads (WAV, FLAC, OGG, ...) at a common sample rate from 8 to 192 kHz; up to 8
channels, averaged; other rates resampled with a polyphase filter. Every problem is a
RequestError naming the field, so one bad upload fails its request and nothing else.
"""

from __future__ import annotations

import io
import math

import numpy as np

from ..errors import RequestError

SAMPLE_RATE = 24000
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
SILENCE_PEAK = 1e-3  # -60 dBFS: below this a recording holds no voice to clone
# +6 dBFS: float samples belong within -1..1; far beyond it the encoders' spectra overflow to NaN
MAX_PEAK = 2.0
MAX_CHANNELS = 8
MAX_RESAMPLING_RATIO = 1000  # 44.1 kHz is 80/147 of 24 kHz, 11.025 kHz 320/147
UNKNOWN_FRAMES = 2**63 - 1  # libsndfile's length of a file whose header gives none (a FLAC written to a pipe)


def read_reference_audio(raw: bytes, field: str = "reference_audio") -> np.ndarray:
    """float32 [samples] at 24 kHz, between 1 and 30 s long and not silent. The header is checked
    before anything is decoded, and no more than 30 s is decoded, mixed down a second at a time: a
    small file that decodes to hours or to hundreds of channels costs no more than a real one."""
    import soundfile

    if not raw:
        raise RequestError(field, "is empty (expected an audio file's bytes: WAV, FLAC, ...)")
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as file:
            rate, channels, frames = file.samplerate, file.channels, file.frames
            _check_header(field, rate, channels, frames)
            limit = int(MAX_SECONDS * rate) + 1  # one frame past 30 s tells a header that understated
            if channels == 1:  # at most 30 s of samples: one read (half the time of the blocks below)
                audio = file.read(frames=limit, dtype="float32")
            else:
                blocks = file.blocks(blocksize=rate, dtype="float32", always_2d=True, frames=limit)
                audio = np.concatenate([block.mean(axis=1) for block in blocks] or [np.zeros(0, np.float32)])
    except RequestError:
        raise
    except Exception as error:  # libsndfile's errors have no common type
        # "Error opening <_io.BytesIO object at 0x...>: Format not recognised." -> its reason alone
        reason = str(error).rsplit(": ", 1)[-1].rstrip(".") or type(error).__name__
        raise RequestError(
            field, f"not an audio file that can be read (WAV, FLAC, OGG, MP3, ...): {reason}"
        ) from None
    seconds = audio.shape[0] / rate
    if seconds < MIN_SECONDS:
        shown = math.floor(seconds * 100) / 100  # rounded down: 0.9995 s is not "1.00 s (at least 1 s)"
        raise RequestError(field, f"too short: {shown:.2f} s (at least {MIN_SECONDS:g} s)")
    if seconds > MAX_SECONDS:
        raise RequestError(field, f"too long: over {MAX_SECONDS:g} s")
    if not np.isfinite(audio).all():
        raise RequestError(field, "holds samples that are not finite numbers")
    peak = np.abs(audio).max()
    if peak < SILENCE_PEAK:
        raise RequestError(field, "is silent (peak below -60 dBFS)")
    if peak > MAX_PEAK:
        raise RequestError(
            field, f"peak {peak:.3g} is far beyond full scale (float samples belong within -1..1)"
        )
    if rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        common = math.gcd(rate, SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // common, rate // common)
    return np.ascontiguousarray(audio, dtype=np.float32)


def _check_header(field: str, rate: int, channels: int, frames: int) -> None:
    if not 8000 <= rate <= 192000:
        raise RequestError(field, f"sample rate {rate} Hz is not supported (8000 to 192000)")
    common = math.gcd(rate, SAMPLE_RATE)
    if max(SAMPLE_RATE // common, rate // common) > MAX_RESAMPLING_RATIO:
        # A rate sharing almost no factor with 24 kHz needs a polyphase filter thousands of taps long.
        raise RequestError(
            field,
            f"sample rate {rate} Hz is not supported: use a common one (16000, 22050, 44100, 48000, ...)",
        )
    if channels > MAX_CHANNELS:
        raise RequestError(field, f"{channels} channels (at most {MAX_CHANNELS}; they are mixed down)")
    if frames == UNKNOWN_FRAMES:  # libsndfile cannot read on through such a file (its seeks fail)
        raise RequestError(
            field, "its header gives no length (written as a stream?); send WAV, or a FLAC file"
        )
    if frames / rate > MAX_SECONDS:
        raise RequestError(field, f"too long: {frames / rate:.2f} s (at most {MAX_SECONDS:g} s)")
