"""Sync and asyncio clients for the `tts` model (decoupled, gRPC streaming).

Both build the same request (`request_inputs`) and return the same `Synthesis`: the chunks with
their arrival times, the audio, and what a listener would have experienced.
"""

from __future__ import annotations

import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from .playback import PlaybackReport, simulate_playback

SAMPLE_RATE = 24000
MODEL = "tts"
LANES = {0: "urgent", 1: "background", 2: "inline"}  # chunk_info's lane code: where the chunk was decoded

# input name -> numpy dtype, as declared in model_repository/tts/config.pbtxt
INPUT_TYPES = {
    "text": np.object_,
    "speaker": np.object_,
    "language": np.object_,
    "instruct": np.object_,
    "seed": np.int64,
    "max_frames": np.int32,
    "ignore_eos": np.bool_,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "repetition_penalty": np.float32,
    "reference_audio": np.object_,  # Base checkpoints: a recording's file bytes (WAV, FLAC)
    "reference_text": np.object_,
}


class SynthesisError(RuntimeError):
    """The server ended the stream with an error (its message names the field or the cause)."""


@dataclass
class Chunk:
    audio: np.ndarray  # float32, mono, 24 kHz
    arrived_s: float  # seconds after the request was sent
    codes: np.ndarray | None = None  # [frames, 16], when requested
    # [chunk index, first frame, frames, lane code (LANES)], when requested
    info: np.ndarray | None = None

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE


@dataclass
class Synthesis:
    chunks: list[Chunk] = field(default_factory=list)
    error: str | None = None
    completed: bool = False  # the final response arrived

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([c.audio for c in self.chunks]) if self.chunks else np.zeros(0, np.float32)

    @property
    def codes(self) -> np.ndarray | None:
        parts = [c.codes for c in self.chunks if c.codes is not None]
        return np.concatenate(parts) if parts else None

    @property
    def playback(self) -> PlaybackReport:
        return simulate_playback(0.0, [(c.arrived_s, c.seconds) for c in self.chunks])

    def raise_for_error(self) -> "Synthesis":
        if self.error is not None:
            raise SynthesisError(self.error)
        return self


def request_inputs(client_module, text: str, **options) -> list:
    """InferInput list for `tts`; options are the optional inputs (None = server default)."""
    values = {"text": text, **{k: v for k, v in options.items() if v is not None}}
    unknown = set(values) - set(INPUT_TYPES)
    if unknown:
        raise TypeError(f"unknown tts input(s): {', '.join(sorted(unknown))}")
    inputs = []
    for name, value in values.items():
        dtype = INPUT_TYPES[name]
        array = np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=dtype)
        tensor = client_module.InferInput(name, [1], np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def requested_outputs(client_module, codes: bool, info: bool) -> list:
    names = ["audio"] + (["codes"] if codes else []) + (["chunk_info"] if info else [])
    return [client_module.InferRequestedOutput(name) for name in names]


def _chunk_from(result, sent_at: float) -> Chunk:
    names = {output.name for output in result.get_response().outputs}
    return Chunk(
        result.as_numpy("audio").astype(np.float32, copy=False),
        time.perf_counter() - sent_at,
        result.as_numpy("codes") if "codes" in names else None,
        result.as_numpy("chunk_info") if "chunk_info" in names else None,
    )


def _is_final(result) -> bool:
    parameter = result.get_response().parameters.get("triton_final_response")
    return parameter is not None and parameter.bool_param


def _consume(synthesis: Synthesis, result, error, sent_at: float) -> tuple[Chunk | None, bool]:
    """Apply one stream event to `synthesis`: (the chunk it carried, if any; whether the stream is over)."""
    if error is not None:
        synthesis.error = error.message() if isinstance(error, InferenceServerException) else str(error)
        return None, True
    chunk = None
    if result.get_response().outputs:
        chunk = _chunk_from(result, sent_at)
        synthesis.chunks.append(chunk)
    synthesis.completed = _is_final(result)
    return chunk, synthesis.completed


class TTSClient:
    """Blocking client. One gRPC stream per synthesis, so several can run from several threads."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = MODEL):
        self.url, self.model = url, model

    def stream(
        self, text: str, *, codes: bool = False, info: bool = False, timeout: float = 300.0, **options
    ) -> Iterator[tuple[Chunk | None, Synthesis]]:
        """Yield (chunk, synthesis so far) as chunks arrive; the last item has chunk None."""
        client = grpcclient.InferenceServerClient(self.url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        synthesis = Synthesis()
        try:
            sent_at = time.perf_counter()
            try:
                client.async_stream_infer(
                    self.model,
                    request_inputs(grpcclient, text, **options),
                    request_id=uuid.uuid4().hex,
                    outputs=requested_outputs(grpcclient, codes, info),
                    enable_empty_final_response=True,
                )
            except InferenceServerException as refused:
                # The stream failed before the request went out (say, a proxy with no server behind
                # it): the cause comes through the callback.
                try:
                    _, cause = responses.get(timeout=1.0)
                except queue.Empty:
                    cause = None
                _consume(synthesis, None, cause or refused, sent_at)
            deadline = sent_at + timeout
            while synthesis.error is None:
                try:
                    result, error = responses.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    synthesis.error = f"no final response within {timeout} s"
                    break
                chunk, over = _consume(synthesis, result, error, sent_at)
                if chunk is not None:
                    yield chunk, synthesis
                if over:
                    break
        finally:  # a stream left early (an exception, or the caller stopped iterating) is cancelled
            client.stop_stream(cancel_requests=not synthesis.completed)
            client.close()
        yield None, synthesis

    def synthesize(self, text: str, on_chunk: Callable[[Chunk], None] | None = None, **kwargs) -> Synthesis:
        synthesis = Synthesis()
        for chunk, synthesis in self.stream(text, **kwargs):
            if chunk is not None and on_chunk is not None:
                on_chunk(chunk)
        return synthesis


class AsyncTTSClient:
    """asyncio client: many concurrent syntheses from one event loop (one gRPC channel)."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = MODEL):
        self.url, self.model = url, model
        self.client = aioclient.InferenceServerClient(url)

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> "AsyncTTSClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def synthesize(
        self,
        text: str,
        *,
        codes: bool = False,
        info: bool = False,
        on_chunk: Callable[[Chunk], None] | None = None,
        **options,
    ) -> Synthesis:
        synthesis = Synthesis()
        inputs = request_inputs(aioclient, text, **options)
        outputs = requested_outputs(aioclient, codes, info)

        async def requests() -> AsyncIterator[dict]:
            yield {
                "model_name": self.model,
                "inputs": inputs,
                "outputs": outputs,
                "request_id": uuid.uuid4().hex,
                "enable_empty_final_response": True,
            }

        sent_at = time.perf_counter()
        async for result, error in self.client.stream_infer(requests()):
            chunk, over = _consume(synthesis, result, error, sent_at)
            if chunk is not None and on_chunk is not None:
                on_chunk(chunk)
            if over:
                break
        return synthesis
