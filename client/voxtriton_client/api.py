"""Sync and asyncio clients for the `tts` model (decoupled, gRPC streaming).

Both build the same request (`request_inputs`) and return the same `Synthesis`: the chunks with
their arrival times, the audio, and what a listener would have experienced.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator

import grpc
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
    "start_frames": np.int32,  # input streams: the first chunk's frames at least
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
    # Input streaming (`TTSClient.stream_text`): when the last text piece went out, in seconds after
    # the first (the clock `Chunk.arrived_s` counts on).
    last_piece_s: float | None = None
    # The zero of those times, on time.perf_counter()'s clock: to line a synthesis up with other
    # records of the same host (a server's chunk trace, say).
    sent_at: float = 0.0

    @property
    def first_audio_after_first_piece_s(self) -> float | None:
        """Input streaming: from sending the first text piece to the first audio (as TTFA)."""
        return self.chunks[0].arrived_s if self.chunks else None

    @property
    def last_audio_after_last_piece_s(self) -> float | None:
        """Input streaming: from sending the last text piece to the last audio."""
        if not self.chunks or self.last_piece_s is None:
            return None
        return self.chunks[-1].arrived_s - self.last_piece_s

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
    if not isinstance(text, str):  # tritonclient would send str(text): None spoken as "None"
        raise TypeError(f"text must be a str, got {type(text).__name__}")
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


def text_request(client_module, model: str, text: str, codes, info, options) -> dict:
    """A whole text's request, as keyword arguments of `async_stream_infer` (and the dict
    `stream_infer` takes); its responses end with an empty final one."""
    return {
        "model_name": model,
        "inputs": request_inputs(client_module, text, **options),
        "request_id": uuid.uuid4().hex,
        "outputs": requested_outputs(client_module, codes, info),
        "enable_empty_final_response": True,
    }


def piece_request(
    client_module, model: str, sequence_id: str, index: int, text: str, end: bool, codes, info, options
) -> dict:
    """Input streaming: the request of a sequence's text piece `index`, as keyword arguments of
    `async_stream_infer` (and the dict `stream_infer` takes). The first carries the options and asks
    for the outputs: the audio comes back on it."""
    if not isinstance(text, str):  # an LLM stream's empty delta is often None, not ""
        raise TypeError(f"text piece {index} must be a str, got {type(text).__name__}")
    first = index == 0
    return {
        "model_name": model,
        "inputs": request_inputs(client_module, text, **(options if first else {})),
        "request_id": f"{sequence_id}-{index}",
        "sequence_id": sequence_id,
        "sequence_start": first,
        "sequence_end": end,
        "outputs": requested_outputs(client_module, codes, info) if first else None,
        "enable_empty_final_response": first,
    }


class _Clock:
    """Seconds since its zero: a request's sending, or an input stream's first piece; the zero is
    also the synthesis's `sent_at`."""

    def __init__(self, synthesis: Synthesis):
        self.synthesis = synthesis
        self.restart()

    def restart(self) -> None:
        self.zero = self.synthesis.sent_at = time.perf_counter()

    def since(self, moment: float | None = None) -> float:
        return (time.perf_counter() if moment is None else moment) - self.zero


def pieces_failed(error: Exception) -> str:
    """A synthesis's error when the iterator of its text pieces raised."""
    return f"text pieces failed: {error!r}"


def _chunk_from(result, arrived_s: float) -> Chunk:
    names = {output.name for output in result.get_response().outputs}
    return Chunk(
        result.as_numpy("audio").astype(np.float32, copy=False),
        arrived_s,
        result.as_numpy("codes") if "codes" in names else None,
        result.as_numpy("chunk_info") if "chunk_info" in names else None,
    )


def _is_final(result) -> bool:
    parameter = result.get_response().parameters.get("triton_final_response")
    return parameter is not None and parameter.bool_param


def _consume(synthesis: Synthesis, result, error, arrived_s: float) -> tuple[Chunk | None, bool]:
    """Apply one stream event, which arrived `arrived_s` after the clock's zero, to `synthesis`: (the
    chunk it carried, if any; whether the stream is over)."""
    if error is not None:
        synthesis.error = error.message() if isinstance(error, InferenceServerException) else str(error)
        return None, True
    chunk = None
    if result.get_response().outputs:
        chunk = _chunk_from(result, arrived_s)
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
        request = text_request(grpcclient, self.model, text, codes, info, options)

        def send(post, synthesis, clock):
            post(**request)

        yield from self._stream(send, timeout)

    def stream_text(
        self,
        pieces: Iterable[str],
        *,
        codes: bool = False,
        info: bool = False,
        timeout: float = 300.0,
        **options,
    ) -> Iterator[tuple[Chunk | None, Synthesis]]:
        """Input streaming: send text pieces as they come (from an LLM, say) and yield (chunk, synthesis
        so far) as audio arrives, while later pieces are still being sent; the last item has chunk
        None. The pieces go out as one Triton sequence on one gRPC stream, the options with the first,
        and an empty piece with sequence_end after the last. Times count from the first piece, and
        `timeout` from the first piece too once one came (else from the call)."""
        request_inputs(grpcclient, "", **options)  # a bad option raises here, not as the pieces' failure
        sequence_id = uuid.uuid4().hex

        def send(post, synthesis, clock):
            sent = 0
            for text in pieces:
                if sent == 0:
                    clock.restart()
                if not post(
                    **piece_request(
                        grpcclient, self.model, sequence_id, sent, text, False, codes, info, options
                    )
                ):
                    return  # the synthesis is over
                sent += 1
                synthesis.last_piece_s = clock.since()
            if sent == 0:
                clock.restart()
            post(**piece_request(grpcclient, self.model, sequence_id, sent, "", True, codes, info, options))

        yield from self._stream(send, timeout, in_background=True)

    def _stream(
        self, send, timeout: float, in_background: bool = False
    ) -> Iterator[tuple[Chunk | None, Synthesis]]:
        """Open a gRPC stream and run `send(post, synthesis, clock)` on it (on a thread of its own if
        `in_background`): `post(**request)` sends a request, False once the synthesis is over;
        `clock` is the zero of the chunks' times. Yield the chunks that come back."""
        client = grpcclient.InferenceServerClient(self.url)
        responses: queue.Queue = queue.Queue()
        stream_failed = threading.Event()

        def on_response(result, error):
            # Stamped here: a slow consumer of this generator must not make its chunks look late.
            responses.put((result, error, time.perf_counter()))
            if error is not None:
                stream_failed.set()

        client.start_stream(callback=on_response)
        synthesis = Synthesis()
        clock = _Clock(synthesis)
        posting, over = threading.Lock(), threading.Event()

        def post(**request) -> bool:
            with posting:  # never on a stream being stopped
                if over.is_set():
                    return False
                client.async_stream_infer(**request)
                return True

        def send_or_fail():
            try:
                send(post, synthesis, clock)
            except InferenceServerException as refused:
                # The stream failed before the request went out (say, a proxy with no server behind
                # it): the cause comes through the callback, if it comes at all.
                if not stream_failed.wait(1.0):
                    responses.put((None, refused, time.perf_counter()))
            except Exception as error:  # the pieces' iterator failed: end the synthesis with it
                responses.put((None, pieces_failed(error), time.perf_counter()))

        try:
            if in_background:
                threading.Thread(target=send_or_fail, daemon=True).start()
            else:
                send_or_fail()
            while synthesis.error is None:
                try:
                    result, error, arrived = responses.get(
                        timeout=max(0.0, clock.zero + timeout - time.perf_counter())
                    )
                except queue.Empty:
                    if time.perf_counter() < clock.zero + timeout:
                        continue  # the first piece came during the wait and moved the clock's zero
                    synthesis.error = f"no final response within {timeout} s"
                    break
                chunk, ended = _consume(synthesis, result, error, clock.since(arrived))
                if chunk is not None:
                    yield chunk, synthesis
                if ended:
                    break
        finally:  # a stream left early (an exception, or the caller stopped iterating) is cancelled
            with posting:  # a sender still reading its pieces sends no more
                over.set()
            _stop_stream(client, cancel=not synthesis.completed)
            client.close()
        yield None, synthesis

    def synthesize(self, text: str, on_chunk: Callable[[Chunk], None] | None = None, **kwargs) -> Synthesis:
        return _collect(self.stream(text, **kwargs), on_chunk)

    def synthesize_text_stream(
        self, pieces: Iterable[str], on_chunk: Callable[[Chunk], None] | None = None, **kwargs
    ) -> Synthesis:
        """`stream_text` to its end: the whole synthesis."""
        return _collect(self.stream_text(pieces, **kwargs), on_chunk)


def _stop_stream(client: grpcclient.InferenceServerClient, cancel: bool) -> None:
    """Stop the client's stream. A cancel also ends the stream's request queue: tritonclient (2.73)
    cancels the call but leaves gRPC's request thread waiting on that queue, one thread per
    synthesis that did not complete."""
    stream = client._stream
    client.stop_stream(cancel_requests=cancel)
    if cancel and stream is not None:
        stream._request_queue.put(None)


def _collect(events: Iterator[tuple[Chunk | None, Synthesis]], on_chunk) -> Synthesis:
    synthesis = Synthesis()
    for chunk, synthesis in events:
        if chunk is not None and on_chunk is not None:
            on_chunk(chunk)
    return synthesis


class AsyncTTSClient:
    """asyncio client: many concurrent syntheses from one event loop (one gRPC channel). Make it in
    the loop that uses it (inside `asyncio.run`): grpc.aio ties the channel to the running loop."""

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
        timeout: float = 300.0,
        **options,
    ) -> Synthesis:
        """The whole synthesis: its chunks reach `on_chunk` as they arrive; after `timeout` s without
        the final response it ends with an error."""
        request = text_request(aioclient, self.model, text, codes, info, options)

        async def requests() -> AsyncIterator[dict]:
            yield request

        synthesis = Synthesis()
        return await self._read(requests(), synthesis, _Clock(synthesis), on_chunk, timeout)

    async def synthesize_text_stream(
        self,
        pieces: AsyncIterable[str] | Iterable[str],
        *,
        codes: bool = False,
        info: bool = False,
        on_chunk: Callable[[Chunk], None] | None = None,
        timeout: float = 300.0,
        **options,
    ) -> Synthesis:
        """Input streaming (`TTSClient.stream_text`): the pieces, as they come, go out as one Triton
        sequence; chunks reach `on_chunk` as they arrive. Times count from the first piece; `timeout`
        from the call. A plain iterable is read on a worker thread: it may block (stdin, say)."""
        request_inputs(aioclient, "", **options)  # a bad option raises here, not as the pieces' failure
        synthesis = Synthesis()
        clock = _Clock(synthesis)
        sequence_id = uuid.uuid4().hex

        async def requests() -> AsyncIterator[dict]:
            index = 0
            try:
                async for text in _async_iter(pieces):
                    if index == 0:
                        clock.restart()
                    yield piece_request(
                        aioclient, self.model, sequence_id, index, text, False, codes, info, options
                    )
                    synthesis.last_piece_s = clock.since()
                    index += 1
            except Exception as error:  # gRPC cancels the call for it, and keeps no cause
                synthesis.error = pieces_failed(error)
                raise
            if index == 0:
                clock.restart()
            yield piece_request(aioclient, self.model, sequence_id, index, "", True, codes, info, options)

        return await self._read(requests(), synthesis, clock, on_chunk, timeout)

    async def _read(
        self, requests, synthesis: Synthesis, clock: _Clock, on_chunk, timeout: float
    ) -> Synthesis:
        """Send `requests` on one stream and apply its responses until the final one, an error, or
        `timeout` s after the call; then cancel the call, whose request side may still be pulling
        pieces. A failure to reach the server raises grpc.aio.AioRpcError."""
        responses = self.client.stream_infer(requests, stream_timeout=timeout)
        try:
            async for result, error in responses:
                chunk, over = _consume(synthesis, result, error, clock.since())
                if chunk is not None and on_chunk is not None:
                    on_chunk(chunk)
                if over:
                    break
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            synthesis.error = f"no final response within {timeout} s"
        except asyncio.CancelledError:
            if synthesis.error is None or asyncio.current_task().cancelling():
                raise  # this task's cancel, not the call's for the pieces' failure
        finally:
            responses.cancel()
        return synthesis


async def _async_iter(pieces):
    if hasattr(pieces, "__aiter__"):
        async for piece in pieces:
            yield piece
        return
    # A plain iterable may block (stdin): it is read on a daemon thread of its own, which a synthesis
    # that ends first leaves behind; `asyncio.run` would wait for a thread of its default executor.
    loop, read = asyncio.get_running_loop(), asyncio.Queue()
    done = object()

    def hand(item) -> bool:
        try:
            loop.call_soon_threadsafe(read.put_nowait, item)
            return True
        except RuntimeError:  # the loop closed: nobody reads on
            return False

    def reader():
        try:
            for piece in pieces:
                if not hand((piece, None)):
                    return
        except Exception as error:
            hand((None, error))
            return
        hand((done, None))

    threading.Thread(target=reader, daemon=True, name="voxtriton-text-pieces").start()
    while True:
        piece, error = await read.get()
        if error is not None:
            raise error
        if piece is done:
            return
        yield piece
