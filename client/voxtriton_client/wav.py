"""A WAV file that is valid after every chunk: the header's sizes are rewritten as audio arrives."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


class StreamingWavWriter:
    """Mono 16-bit PCM; float samples in [-1, 1] are clipped and scaled."""

    def __init__(self, path: str | Path, sample_rate: int = 24000):
        self.file = open(path, "wb")
        self.sample_rate = sample_rate
        self.samples = 0
        self._write_header()

    def _write_header(self) -> None:
        data = self.samples * 2
        self.file.seek(0)
        self.file.write(b"RIFF" + struct.pack("<I", 36 + data) + b"WAVE")
        self.file.write(
            b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, self.sample_rate, self.sample_rate * 2, 2, 16)
        )
        self.file.write(b"data" + struct.pack("<I", data))

    def write(self, audio: np.ndarray) -> None:
        pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).round().astype("<i2")
        self.file.seek(0, 2)
        self.file.write(pcm.tobytes())
        self.samples += len(pcm)
        self._write_header()
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()

    def __enter__(self) -> "StreamingWavWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
