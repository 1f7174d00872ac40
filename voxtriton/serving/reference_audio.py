"""Reference recordings for voice cloning: file bytes -> a checked mono waveform at 24 kHz.

Any format libsndfile reads (WAV, FLAC, OGG, ...) at any sample rate from 8 to 192 kHz; several
channels are averaged, other rates resampled with a polyphase filter. Every problem is a
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


def read_reference_audio(raw: bytes, field: str = "reference_audio") -> np.ndarray:
    """float32 [samples] at 24 kHz, between 1 and 30 s long and not silent."""
    import soundfile

    if not raw:
        raise RequestError(field, "is empty (expected an audio file's bytes: WAV, FLAC, ...)")
    try:
        audio, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as error:  # libsndfile's errors have no common type
        # "Error opening <_io.BytesIO object at 0x...>: Format not recognised." -> its reason alone
        reason = str(error).rsplit(": ", 1)[-1].rstrip(".") or type(error).__name__
        raise RequestError(
            field, f"not an audio file that can be read (WAV, FLAC, OGG, MP3, ...): {reason}"
        ) from None
    if not 8000 <= rate <= 192000:
        raise RequestError(field, f"sample rate {rate} Hz is not supported (8000 to 192000)")
    seconds = audio.shape[0] / rate
    if seconds < MIN_SECONDS:
        raise RequestError(field, f"too short: {seconds:.2f} s (at least {MIN_SECONDS:g} s)")
    if seconds > MAX_SECONDS:
        raise RequestError(field, f"too long: {seconds:.2f} s (at most {MAX_SECONDS:g} s)")
    audio = audio.mean(axis=1)
    if not np.isfinite(audio).all():
        raise RequestError(field, "holds samples that are not finite numbers")
    if np.abs(audio).max() < SILENCE_PEAK:
        raise RequestError(field, "is silent (peak below -60 dBFS)")
    if rate != SAMPLE_RATE:
        from scipy.signal import resample_poly

        common = math.gcd(rate, SAMPLE_RATE)
        audio = resample_poly(audio, SAMPLE_RATE // common, rate // common)
    return np.ascontiguousarray(audio, dtype=np.float32)
