"""`voxtriton gateway`: an OpenAI-compatible HTTP front end for one or more voxtriton servers.

    POST /v1/audio/speech   {"model", "input", "voice", "response_format": "wav"|"pcm", "speed",
                             "instructions", and voxtriton's "language", "seed", "max_frames", "ignore_eos"}

Audio streams to the caller as the chunks arrive from Triton (gRPC streaming; Triton's own HTTP
endpoint cannot stream decoupled models): `pcm` is 16-bit little-endian mono at 24 kHz (as the
OpenAI API defines it), `wav` the same behind a WAV header of unknown length. Errors are OpenAI-style
JSON with a matching status: 400 for a bad field, 503 (with Retry-After) when every server is busy,
502 when a server fails. With several backends (one tritonserver per GPU) each request goes to the
backend with the fewest streams in flight from this gateway. `GET /` is a small browser playground.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at runtime,
# and `Request` is only imported inside create_app (the gateway extra need not be installed otherwise).
import argparse
import asyncio
import itertools
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models.config import load_config

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
if str(CLIENT_DIR) not in sys.path:  # the client package lives in client/ of a source checkout
    sys.path.insert(0, str(CLIENT_DIR))

from voxtriton_client import AsyncTTSClient  # noqa: E402
from voxtriton_client.api import INPUT_TYPES  # noqa: E402

SAMPLE_RATE = 24000
PLAYGROUND = Path(__file__).parent / "playground.html"


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


class SpeechError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


# voxtriton input -> OpenAI request field, for error messages in the caller's vocabulary
FIELD_NAMES = {"text": "input", "speaker": "voice", "instruct": "instructions"}


def parse_speech_request(body: dict) -> dict:
    """OpenAI speech request -> tts inputs; SpeechError(400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise SpeechError(400, "request body must be a JSON object")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise SpeechError(400, "input: must be a non-empty string", "input")
    if not isinstance(body.get("model", "tts"), str):
        raise SpeechError(400, "model: must be a string", "model")
    response_format = body.get("response_format", "wav")
    if response_format not in ("wav", "pcm"):
        raise SpeechError(
            400, f"response_format: {response_format!r} is not supported (use wav or pcm)", "response_format"
        )
    speed = body.get("speed", 1.0)
    if not isinstance(speed, (int, float)) or speed != 1.0:
        raise SpeechError(400, "speed: only 1.0 is supported (the model has no speed control)", "speed")
    options: dict = {"format": response_format}
    for source, target, kind in (
        ("voice", "speaker", str),
        ("instructions", "instruct", str),
        ("language", "language", str),
        ("seed", "seed", int),
        ("max_frames", "max_frames", int),
        ("ignore_eos", "ignore_eos", bool),
    ):
        value = body.get(source)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpeechError(400, f"{source}: must be a {kind.__name__}", source)
        options[target] = value
    options["text"] = text
    return options


@dataclass
class Backend:
    url: str
    in_flight: int = 0
    clients: dict = field(default_factory=dict)  # one client per event loop

    def client(self) -> AsyncTTSClient:
        loop = asyncio.get_running_loop()
        if loop not in self.clients:
            self.clients[loop] = AsyncTTSClient(self.url)
        return self.clients[loop]


class Router:
    """Least-loaded routing over backends by the streams this gateway has in flight on each."""

    def __init__(self, urls: list[str]):
        self.backends = [Backend(url) for url in urls]
        self._order = itertools.count()

    def pick(self) -> Backend:
        turn = next(self._order)  # ties go round-robin
        count = len(self.backends)
        return min((self.backends[(turn + i) % count] for i in range(count)), key=lambda b: b.in_flight)

    async def synthesize(self, text: str, **options):
        """One synthesis on the least-loaded backend (`AsyncTTSClient.synthesize`'s arguments)."""
        backend = self.pick()
        backend.in_flight += 1
        try:
            return await backend.client().synthesize(text, **options)
        finally:
            backend.in_flight -= 1

    async def close(self) -> None:
        """Close this event loop's clients."""
        loop = asyncio.get_running_loop()
        for backend in self.backends:
            client = backend.clients.pop(loop, None)
            if client is not None:
                await client.close()


def error_from_server(message: str) -> SpeechError:
    if message.startswith("server busy"):
        return SpeechError(503, message, kind="server_busy")
    field_name = message.split(":", 1)[0]
    if field_name in INPUT_TYPES and ":" in message:
        name = FIELD_NAMES.get(field_name, field_name)
        return SpeechError(400, name + message[len(field_name) :], name)
    return SpeechError(502, f"voxtriton server error: {message}", kind="server_error")


def create_app(backend_urls: list[str], checkpoint: str | None = None):
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

    app = FastAPI(title="voxtriton gateway")
    router = Router(backend_urls)
    voices: list[str] = []
    if checkpoint:
        voices = sorted(load_config(Path(checkpoint)).talker.speakers)

    @app.exception_handler(SpeechError)
    async def speech_error(request: Request, error: SpeechError):
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return PLAYGROUND.read_text()

    @app.get("/v1/voices")
    async def list_voices():
        return {"voices": voices}

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "backends": [{"url": b.url, "in_flight": b.in_flight} for b in router.backends],
        }

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SpeechError(400, "request body must be JSON") from None
        options = parse_speech_request(body)
        response_format = options.pop("format")
        text = options.pop("text")
        chunks: asyncio.Queue = asyncio.Queue()

        async def produce():
            try:
                chunks.put_nowait(
                    await router.synthesize(text, on_chunk=lambda c: chunks.put_nowait(c.audio), **options)
                )
            except Exception as error:  # connection-level failure to the backend
                chunks.put_nowait(error)

        task = asyncio.create_task(produce())
        first = await chunks.get()
        if not isinstance(first, np.ndarray):  # ended before any audio: an error, reported with its status
            await task
            if isinstance(first, Exception):
                raise SpeechError(502, f"voxtriton server unreachable: {first}", kind="server_error")
            raise error_from_server(first.error or "stream ended without audio")

        async def stream():
            if response_format == "wav":
                yield streaming_wav_header()
            item = first
            try:
                while isinstance(item, np.ndarray):
                    yield pcm16(item)
                    item = await chunks.get()
            finally:
                if not task.done():  # the caller went away: stop generating
                    task.cancel()

        media = "audio/wav" if response_format == "wav" else "audio/pcm"
        return StreamingResponse(stream(), media_type=media)

    return app


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="voxtriton Triton gRPC address (repeat for several servers; default 127.0.0.1:8001)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--checkpoint", help="checkpoint directory, to list its voices in the playground")


def run_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from .runtime import ensure_checkpoint

    checkpoint = args.checkpoint or str(ensure_checkpoint(""))
    app = create_app(args.backend or ["127.0.0.1:8001"], checkpoint)
    print(
        f"voxtriton gateway: http://{args.host}:{args.port}/ (playground), POST /v1/audio/speech", flush=True
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
