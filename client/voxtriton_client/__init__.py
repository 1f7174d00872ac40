"""Client for voxtriton: stream speech from the `tts` model over Triton gRPC (sync and asyncio)."""

from .api import AsyncTTSClient, Chunk, Synthesis, SynthesisError, TTSClient
from .playback import PlaybackReport, simulate_playback
from .wav import StreamingWavWriter

__all__ = [
    "AsyncTTSClient",
    "Chunk",
    "PlaybackReport",
    "StreamingWavWriter",
    "Synthesis",
    "SynthesisError",
    "TTSClient",
    "simulate_playback",
]
