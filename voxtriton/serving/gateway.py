"""`voxtriton gateway`: an OpenAI-compatible HTTP front end for a voxtriton server or a proxy.

    POST /v1/audio/speech   OpenAI's speech request: audio streams back as it is generated
    WS   /v1/audio/speech/stream   input streaming: text pieces in, PCM chunks out, on one WebSocket
    GET  /v1/models         the served model, its aliases and its voices
    GET  /health            200 while the backend is ready, 503 while it is not
    GET  /                  the browser playground
    /v1/audio/voices        registered voices of a Base checkpoint (gateway_voices.py)

Audio streams from Triton over gRPC (Triton's own HTTP endpoint cannot stream decoupled models).
`pcm` is 16-bit little-endian mono at 24 kHz, as the OpenAI API defines it; `wav` is the same behind
a header of unknown length; `opus` is Ogg Opus (audio_formats.py); `stream_format: "sse"` sends
OpenAI's `speech.audio.delta` events, each with the chunk's index, frames and codec lane.
docs/gateway.md lists the fields and errors.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at runtime,
# and `Request` is only imported inside create_app (the gateway extra need not be installed otherwise).
import argparse
import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from tritonclient.utils import InferenceServerException
from voxtriton_client import AsyncTTSClient, Chunk, Synthesis
from voxtriton_client.api import INPUT_TYPES, LANES, MODEL

from ..errors import RequestError, utf8
from ..models.config import CheckpointError
from ..models.families import load_family
from .audio_formats import MEDIA_TYPES, check_encoders, new_encoder
from .gateway_voices import BODY_TIMEOUT_S, add_voice_routes, read_body
from .settings import TTSSettings, default_checkpoint_dir, voices_dir
from .voices import UNKNOWN_VOICE

log = logging.getLogger("voxtriton.gateway")

PLAYGROUND = Path(__file__).parent / "playground.html"
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")  # OpenAI's names, for clients that insist on them
HEALTH_TIMEOUT_S = 2.0
API_KEY_ENV = "VOXTRITON_API_KEY"  # --api-key's default
# A stream's whole call to the server: the server bounds what a stream can take (max_frames of audio;
# a text stream open at most text_stream_max_s, 600 s by default), so this only ends the streams of
# a server that stopped answering.
STREAM_TIMEOUT_S = 1800.0
FIRST_MESSAGE_TIMEOUT_S = 30.0  # a text stream's first message, after its WebSocket opened
# A text stream's message at most (uvicorn's default is 16 MiB): the server takes 8 KiB of text in
# all, and a larger message is parsed before its key is checked.
WS_MAX_MESSAGE_BYTES = 64 << 10
AWAITING_FIRST_PER_CONNECTION = 4  # text-stream sockets awaiting a first message, per --max-connections
MAX_CONNECTIONS = 1024  # --max-connections' default: a few servers' max_streams + max_queued
MAX_SPEECH_BODY_BYTES = 1 << 20  # a speech request: its input (the server takes 8 KiB of text) and options

# OpenAI request field -> (tts input, expected JSON type); "input" is the text, checked on its own
OPTIONAL_FIELDS = {
    "voice": ("speaker", str),
    "instructions": ("instruct", str),
    "language": ("language", str),
    "seed": ("seed", int),
    "max_frames": ("max_frames", int),
    "ignore_eos": ("ignore_eos", bool),
}
# A text stream's first message takes these too: the frames its first audio chunk holds at least.
STREAM_OPTIONS = OPTIONAL_FIELDS | {"start_frames": ("start_frames", int)}
REQUEST_FIELDS = ("model", "input", "response_format", "speed", "stream_format", *OPTIONAL_FIELDS)
STREAM_FIELDS = ("input", "end")  # of every message of a text stream; the first may hold the options too
TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}
# tts input -> OpenAI request field, for errors from the server in the caller's vocabulary
FIELD_NAMES = {"text": "input", "speaker": "voice", "instruct": "instructions"}


async def encoded(encoder, method, *args) -> bytes:
    """An encoder call: on a worker thread for one that blocks (opus), so the event loop keeps serving
    the other streams; in place for pcm and wav."""
    return await asyncio.to_thread(method, *args) if encoder.blocking else method(*args)


class SpeechError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_api_key() -> SpeechError:
    return SpeechError(
        401,
        "Authorization: this gateway needs its API key, as the header 'Authorization: Bearer KEY'",
        code="invalid_api_key",
    )


def bearer_token(header: str | None) -> str | None:
    """The token of an 'Authorization: Bearer TOKEN' header, or None."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(given, key: str) -> bool:
    """Whether `given` (a header's token, a message's field: anything) is the key."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), key.encode())


def error_response(error: SpeechError, headers: dict | None = None):
    """The JSON response of `error`, for the exception handler and the middlewares before it; a 503
    tells the client to retry in a second."""
    from fastapi.responses import JSONResponse

    retry = {"Retry-After": "1"} if error.status == 503 else {}
    return JSONResponse(error.body(), status_code=error.status, headers={**retry, **(headers or {})})


class RequireApiKey:
    """ASGI middleware: every HTTP request under /v1/ carries the key as a bearer token, or gets a
    401. The playground and /health stay open; the text-stream WebSocket checks the key itself (a
    browser cannot set its headers). Plain ASGI, so streamed responses and disconnects pass as they are."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not key_matches(bearer_token(header), self.key):
                await error_response(bad_api_key(), {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenLimit:
    """At most `limit` /v1/ requests and text streams open at once, so clients that open streams and
    never read them hold a bounded share of the gateway's sockets and memory. An HTTP request takes
    its slot as it arrives (`LimitOpen`); a text stream once its first message is in and its key
    checked, so a silent or keyless socket takes none from the clients that have the key."""

    def __init__(self, limit: int):
        self.limit, self.open = limit, 0

    def busy(self) -> SpeechError | None:
        """The refusal while every slot is taken, else None."""
        if self.open < self.limit:
            return None
        return SpeechError(
            503, f"The gateway has {self.limit} requests open; retry shortly.", kind="server_busy"
        )

    @contextlib.contextmanager
    def slot(self):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class LimitOpen:
    """ASGI middleware: every HTTP request under /v1/ holds a slot of `limits` until its response
    ends or its client leaves; past the limit, a 503. The playground and /health are not counted."""

    def __init__(self, app, limits: OpenLimit):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if error := self.limits.busy():
            await error_response(error)(scope, receive, send)
            return
        with self.limits.slot():
            await self.app(scope, receive, send)


def close_code(error: SpeechError | None) -> int:
    """A text stream's WebSocket close code for how it ended, as its status says: 1013 (try again
    later) for a 503 (busy, shutting down, no server: what HTTP's Retry-After marks), 1011 for
    another 5xx (a failure), 1000 otherwise (done, or a bad field)."""
    if error is None or error.status < 500:
        return 1000
    return 1013 if error.status == 503 else 1011


def unreachable() -> SpeechError:
    return SpeechError(503, "No voxtriton server is ready; retry when one is up.", kind="service_unavailable")


def resolve_model(name) -> str:
    """The served model for a requested name (its own or an alias); SpeechError(400) otherwise."""
    if not isinstance(name, str):
        raise SpeechError(400, "model: must be a string", "model")
    if name != MODEL and name not in MODEL_ALIASES:
        served = ", ".join((MODEL, *MODEL_ALIASES))
        raise SpeechError(400, f"model: unknown model {name!r}; this gateway serves {served}", "model")
    return MODEL


def parse_speech_request(body: dict) -> dict:
    """OpenAI speech request -> tts inputs plus "format" and "sse"; SpeechError(400) naming the field."""
    if not isinstance(body, dict):
        raise SpeechError(400, "request body must be a JSON object")
    unknown = [name for name in body if name not in REQUEST_FIELDS]
    if unknown:
        raise SpeechError(
            400,
            f"{', '.join(unknown)}: unknown field{'s' if len(unknown) > 1 else ''}; "
            f"supported: {', '.join(REQUEST_FIELDS)}",
            unknown[0],
        )
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise SpeechError(400, "input: must be a non-empty string", "input")
    check_unicode(text, "input")
    resolve_model(body.get("model", MODEL))
    response_format = parse_response_format(body.get("response_format", "wav"))
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise SpeechError(400, f"stream_format: {stream_format!r} is not one of audio, sse", "stream_format")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed != 1.0:
        raise SpeechError(400, "speed: only 1.0 is supported (the model has no speed control)", "speed")
    options = {"format": response_format, "sse": stream_format == "sse", **voice_options(body)}
    options["text"] = text
    return options


def voice_options(body: dict, fields: dict = OPTIONAL_FIELDS) -> dict:
    """The tts inputs of a request's `fields`; SpeechError(400) naming a field of the wrong type."""
    options = {}
    for source, (target, kind) in fields.items():
        value = body.get(source)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpeechError(400, f"{source}: must be {TYPE_NAMES[kind]}", source)
        if kind is str:
            check_unicode(value, source)
        if kind is int:  # as the tts input's type holds it (numpy would wrap a larger one around)
            value = integer_input(source, value, np.iinfo(INPUT_TYPES[target]))
        options[target] = value
    return options


def integer_input(source: str, value: int, limits: np.iinfo) -> int:
    """An integer field's value within its tts input's type; SpeechError(400) with the field's own
    range where the type cannot hold it. A start_frames above it is the largest (as any above the
    chunk schedule's largest size)."""
    if limits.min <= value <= limits.max:
        return value
    if source == "start_frames":
        if value > limits.max:
            return int(limits.max)
        raise SpeechError(400, f"start_frames: must be at least 1, got {value}", source)
    if source == "max_frames":
        bounds = f"between 1 and the server's max_frames ({TTSSettings.max_frames} unless set otherwise)"
    else:
        bounds = f"between {limits.min} and {limits.max}"
    raise SpeechError(400, f"{source}: must be {bounds}, got {value}", source)


def check_unicode(text: str, field_name: str) -> None:
    """SpeechError(400) naming the field for a string with no UTF-8 form (a lone surrogate)."""
    try:
        utf8(text, field_name)
    except RequestError as error:
        raise SpeechError(400, str(error), field_name) from None


def parse_response_format(value) -> str:
    if not isinstance(value, str) or value not in MEDIA_TYPES:
        raise SpeechError(
            400,
            f"response_format: {value!r} is not supported (use {', '.join(MEDIA_TYPES)})",
            "response_format",
        )
    return value


def parse_text_piece(message, first: bool) -> tuple[str, bool, dict]:
    """One message of a text stream (`/v1/audio/speech/stream`) -> (text piece, whether it is the last,
    the tts options and "format": the first message's only); SpeechError(400) naming the field."""
    if not isinstance(message, dict):
        raise SpeechError(400, "each message must be a JSON object")
    allowed = STREAM_FIELDS + (tuple(STREAM_OPTIONS) + ("model", "response_format") if first else ())
    unknown = [name for name in message if name not in allowed]
    if unknown:
        where = "the first message" if first else "a later message (options go in the first)"
        raise SpeechError(
            400, f"{unknown[0]}: unknown field in {where}; supported: {', '.join(allowed)}", unknown[0]
        )
    text, end = message.get("input", ""), message.get("end", False)
    if not isinstance(text, str):
        raise SpeechError(400, "input: must be a string", "input")
    check_unicode(text, "input")
    if not isinstance(end, bool):
        raise SpeechError(400, "end: must be true or false", "end")
    if not first:
        return text, end, {}
    resolve_model(message.get("model", MODEL))
    response_format = parse_response_format(message.get("response_format", "pcm"))
    return text, end, {"format": response_format, **voice_options(message, STREAM_OPTIONS)}


class BackendUnreachable(ConnectionError):
    """The backend did not accept the connection."""


@dataclass
class Backend:
    """The one gRPC address every stream goes to: a voxtriton server, or the proxy that balances
    several (docs/deploy.md). The gateway holds no routing state of its own."""

    url: str
    in_flight: int = 0
    clients: dict = field(default_factory=dict)  # one client per event loop

    def client(self) -> AsyncTTSClient:
        loop = asyncio.get_running_loop()
        if loop not in self.clients:
            self.clients[loop] = AsyncTTSClient(self.url)
        return self.clients[loop]

    async def ready(self) -> bool:
        """Triton is up and its tts model loaded."""
        triton = self.client().client
        try:
            up = await triton.is_server_ready(client_timeout=HEALTH_TIMEOUT_S)
            return up and await triton.is_model_ready(MODEL, client_timeout=HEALTH_TIMEOUT_S)
        except InferenceServerException:
            return False

    async def parameters(self) -> dict[str, str]:
        """The tts model's config.pbtxt parameters as this backend loaded them."""
        config = await self.client().client.get_model_config(
            MODEL, as_json=True, client_timeout=HEALTH_TIMEOUT_S
        )
        # Triton's JSON leaves out an empty string: the parameter then has no "string_value".
        return {key: value.get("string_value", "") for key, value in config["config"]["parameters"].items()}

    async def checkpoint(self) -> Path:
        """The checkpoint directory this backend's tts model loaded ("" there means the default one)."""
        configured = (await self.parameters()).get("checkpoint_dir", "")
        return Path(configured) if configured else default_checkpoint_dir()

    async def max_frames_limit(self) -> int:
        """The most frames this backend generates for one request (`tts:max_frames`)."""
        return int((await self.parameters()).get("max_frames") or TTSSettings.max_frames)

    async def synthesize(self, text: str, on_chunk=None, **options) -> Synthesis:
        """`AsyncTTSClient.synthesize` on this backend; BackendUnreachable when it refuses the connection
        before any audio came back."""
        return await self._call(
            lambda client, deliver: client.synthesize(
                text, on_chunk=deliver, timeout=STREAM_TIMEOUT_S, **options
            ),
            on_chunk,
        )

    async def synthesize_text_stream(self, pieces, on_chunk=None, **options) -> Synthesis:
        """`synthesize` for text that arrives in pieces (an async iterator)."""
        return await self._call(
            lambda client, deliver: client.synthesize_text_stream(
                pieces, on_chunk=deliver, timeout=STREAM_TIMEOUT_S, **options
            ),
            on_chunk,
        )

    async def _call(self, call, on_chunk) -> Synthesis:
        delivered = 0

        def deliver(chunk: Chunk) -> None:
            nonlocal delivered
            delivered += 1
            if on_chunk is not None:
                on_chunk(chunk)

        self.in_flight += 1
        try:
            return await call(self.client(), deliver)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or delivered:
                raise  # a stream cut after its audio began: the caller sees it end early
            log.warning("voxtriton server %s unreachable: %s", self.url, error.details())
            raise BackendUnreachable(self.url) from error
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        """Close this event loop's client."""
        client = self.clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()


def error_from_server(message: str) -> SpeechError:
    """A stream's error message -> the caller's error: the field's 400, busy's 503, or a short 502."""
    if message.startswith("server busy"):
        return SpeechError(503, "The voxtriton server is busy; retry shortly.", kind="server_busy")
    if message.startswith("server shutting down"):
        return SpeechError(503, "The voxtriton server is shutting down; retry shortly.", kind="shutting_down")
    if message.startswith("Request for unknown model"):  # Triton's, while tts loads or after it unloaded
        return unreachable()
    field_name = message.split(":", 1)[0]
    if field_name == "reference_audio":  # not a gateway field: a Base model was given no voice
        return SpeechError(
            400, "voice: this model clones voices: name a registered one (POST /v1/audio/voices)", "voice"
        )
    if field_name in INPUT_TYPES and ":" in message:
        name = FIELD_NAMES.get(field_name, field_name)
        # A text stream's Triton sequence is the gateway's own: its id means nothing to the caller.
        detail = re.sub(r"^: sequence '?[0-9a-f]{32}'?", ": the text stream", message[len(field_name) :])
        return SpeechError(400, name + detail, name)
    log.warning("voxtriton server error: %s", message)
    return SpeechError(
        502, "The voxtriton server failed this request; its log has the cause.", kind="server_error"
    )


def gateway_failed() -> SpeechError:
    """A bug in the gateway, in the errors' shape (its traceback goes to the log)."""
    return SpeechError(500, "internal error in the gateway", kind="server_error")


def cut_short() -> SpeechError:
    return SpeechError(502, "The voxtriton server stopped answering mid-request.", kind="server_error")


class StreamCancelled(ConnectionAbortedError):
    """A stream the gateway stopped (its caller went away): its end is expected, not a failure."""


class StreamCutShort(Exception):
    """A stream that failed after its audio began: the server aborts the response."""


class SpeechStream:
    """One synthesis as it arrives. `start()` waits for the first chunk (raising the SpeechError
    that came instead), `chunks()` yields them all; `failure` says how a started stream failed."""

    def __init__(self, synthesize):
        """synthesize(on_chunk): the Backend call that makes the audio (awaitable of a Synthesis)."""
        self.items: asyncio.Queue = asyncio.Queue()
        self.head: Chunk | None = None
        self.failure: SpeechError | None = None
        self.task = asyncio.create_task(self._produce(synthesize))

    async def _produce(self, synthesize) -> None:
        try:
            self.items.put_nowait(await synthesize(self.items.put_nowait))
        except Exception as error:  # connection-level failure, reported as the stream's end
            self.items.put_nowait(error)
        except asyncio.CancelledError:  # `cancel()`: whoever still reads `chunks()` sees the end
            self.items.put_nowait(StreamCancelled("stream cancelled"))
            raise

    @staticmethod
    def ending(item: Synthesis | Exception) -> SpeechError | None:
        """How the stream ended: None when it completed, else the caller's error."""
        if isinstance(item, BackendUnreachable):
            return unreachable()
        if isinstance(item, Exception):
            if not isinstance(item, StreamCancelled):
                log.warning("voxtriton stream failed: %r", item)
            return cut_short()
        if item.error is not None:
            return error_from_server(item.error)
        return None if item.completed else cut_short()

    async def start(self) -> None:
        item = await self.items.get()
        if isinstance(item, Chunk):
            self.head = item
            return
        await self.task
        error = self.ending(item)
        if error is not None:
            raise error
        self.items.put_nowait(item)  # it completed without audio: chunks() yields none

    async def chunks(self):
        if self.head is not None:
            yield self.head
        while isinstance(item := await self.items.get(), Chunk):
            yield item
        self.failure = self.ending(item)

    def cancel(self) -> None:
        """Stop generating (the caller went away); a no-op once the stream has ended."""
        if not self.task.done():
            self.task.cancel()


async def start_unless_the_client_leaves(stream: SpeechStream, request) -> None:
    """`stream.start()`, cancelling the stream if the client goes away first (its request can wait
    in the server's queue for a while, holding a place there for nobody)."""

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body is read: only that
            pass

    started, left = asyncio.create_task(stream.start()), asyncio.create_task(client_left())
    try:
        await asyncio.wait((started, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if not started.done():
        started.cancel()
        stream.cancel()
        raise SpeechError(400, "the client went away before the first audio")
    started.result()  # its SpeechError, if any


def stream_latencies(times: dict) -> dict:
    """An input stream's latencies as the gateway saw them (event-loop times of its messages)."""
    latencies = {}
    if "first_audio" in times:
        latencies["first_audio_after_first_piece_s"] = times["first_audio"] - times["first_piece"]
    if "last_audio" in times and "last_piece" in times:
        latencies["last_audio_after_last_piece_s"] = times["last_audio"] - times["last_piece"]
    return latencies


def sse_event(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def chunk_description(chunk: Chunk) -> dict:
    index, first_frame, frames, lane = (int(value) for value in chunk.info)
    return {"index": index, "first_frame": first_frame, "frames": frames, "lane": LANES.get(lane, str(lane))}


def create_app(
    backend_url: str,
    checkpoint: str | None = None,
    voices: str = "",
    api_key: str = "",
    max_voices: int = TTSSettings.max_voices,
    max_connections: int = MAX_CONNECTIONS,
    body_timeout_s: float = BODY_TIMEOUT_S,
):
    """api_key: what clients must present ("" = none); max_voices: registered voices at most;
    max_connections: /v1/ requests and text streams open at once; body_timeout_s: a request body's
    whole arrival at most."""
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    check_encoders()
    app = FastAPI(title="voxtriton gateway")
    open_limit = OpenLimit(max_connections)
    # Text-stream sockets before their first message (a key unchecked: they take no `open_limit`
    # slot), each holding at most a message of WS_MAX_MESSAGE_BYTES.
    awaiting_first = OpenLimit(AWAITING_FIRST_PER_CONNECTION * max_connections)
    app.add_middleware(LimitOpen, limits=open_limit)
    if api_key:  # added last, so outermost: a request without the key is refused before it is counted
        app.add_middleware(RequireApiKey, key=api_key)
    backend = Backend(backend_url)

    @app.exception_handler(SpeechError)
    async def speech_error(request: Request, error: SpeechError):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, error: StarletteHTTPException):
        """No such path, or not that method on it: the errors' shape too (with 405's Allow header)."""
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(SpeechError(error.status_code, message, kind=kind), error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        """A bug: the client still gets the JSON error shape."""
        return error_response(gateway_failed())

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return PLAYGROUND.read_text()

    @app.get("/health")
    async def health():
        ready = await backend.ready()
        body = {
            "status": "ok" if ready else "unavailable",
            "backend": {"url": backend.url, "ready": ready, "in_flight": backend.in_flight},
        }
        if ready:
            return body
        return JSONResponse({**body, **unreachable().body()}, status_code=503, headers={"Retry-After": "1"})

    async def served_checkpoint() -> Path:
        if not await backend.ready():
            raise unreachable()
        try:
            return Path(checkpoint) if checkpoint else await backend.checkpoint()
        except InferenceServerException:  # it went down since
            raise unreachable() from None

    async def server_finds(voice: str) -> bool | None:
        """One frame in `voice`: True when it comes, False when the server answers that it knows no
        such voice, None when it cannot tell (busy, unreachable, or no answer within 10 s)."""
        try:
            synthesis = await asyncio.wait_for(
                backend.synthesize("Hello.", speaker=voice, max_frames=1, ignore_eos=True), 10.0
            )
        except Exception as error:  # any failure leaves the question open
            log.warning("could not ask the server for voice %r: %r", voice, error)
            return None
        if synthesis.error is None:
            return True
        return False if UNKNOWN_VOICE in synthesis.error else None

    voice_store = add_voice_routes(
        app, served_checkpoint, server_finds, voices_dir(voices), max_voices, SpeechError, body_timeout_s
    )

    async def model_card() -> dict:
        directory = await served_checkpoint()
        try:
            limit = await backend.max_frames_limit()
        except InferenceServerException:  # it went down since
            raise unreachable() from None
        offers = {}
        try:
            family = load_family(directory)
            # A Base checkpoint's voices are the registered ones.
            names = (
                [v["name"] for v in await asyncio.to_thread(voice_store(family).descriptions)]
                if family.clones_voices
                else []
            )
            voices_list = sorted(family.speakers) + names
            offers = {"offers": family.describe()}
            # the checkpoint's default length, held to what the server allows
            default = offers["offers"]["max_frames"]
            offers["offers"]["max_frames"] = limit if default is None else min(default, limit)
        except (OSError, CheckpointError) as error:  # a backend on another host: its path is not here
            log.warning("voices unknown (%s); give the gateway --checkpoint to list them", error)
            voices_list = []
        return {
            "id": MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "voxtriton",
            "aliases": list(MODEL_ALIASES),
            "voices": voices_list,
            **offers,
        }

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{name}")
    async def retrieve_model(name: str):
        try:
            resolve_model(name)
        except SpeechError as error:
            raise SpeechError(404, error.message, "model", "not_found_error") from None
        return await model_card()

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        try:
            body = json.loads(await read_body(request, MAX_SPEECH_BODY_BYTES, SpeechError, body_timeout_s))
        except (ValueError, RecursionError):  # not JSON or UTF-8, or numbers or nesting past Python's limits
            raise SpeechError(400, "request body must be JSON") from None
        options = parse_speech_request(body)
        response_format, sse, text = options.pop("format"), options.pop("sse"), options.pop("text")
        encoder = new_encoder(response_format)
        stream = SpeechStream(
            lambda on_chunk: backend.synthesize(text, on_chunk=on_chunk, info=sse, **options)
        )
        await start_unless_the_client_leaves(stream, request)

        async def audio():
            try:
                if header := encoder.start():
                    yield header
                async for chunk in stream.chunks():
                    if data := await encoded(encoder, encoder.encode, chunk.audio):
                        yield data
            finally:
                stream.cancel()
            if stream.failure is not None:
                # The status line has gone out: ending the body without its last chunk is how HTTP
                # tells the client the audio is incomplete.
                raise StreamCutShort(stream.failure.message)
            if tail := await encoded(encoder, encoder.finish):
                yield tail

        async def events():
            try:
                async for chunk in stream.chunks():
                    audio = base64.b64encode(await encoded(encoder, encoder.encode, chunk.audio)).decode()
                    delta = {"type": "speech.audio.delta", "audio": audio, "chunk": chunk_description(chunk)}
                    yield sse_event(delta)
            finally:
                stream.cancel()
            if stream.failure is not None:
                yield sse_event({"type": "error", **stream.failure.body()})
                return
            if tail := await encoded(
                encoder, encoder.finish
            ):  # the end of an Ogg stream: no chunk of its own
                yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
            yield sse_event({"type": "speech.audio.done"})

        if sse:
            return StreamingResponse(events(), media_type="text/event-stream")
        return StreamingResponse(audio(), media_type=MEDIA_TYPES[response_format])

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        """Input streaming: JSON text messages in ({"input": piece}, the first with the options, the
        last with "end": true), audio chunks out as binary messages (pcm unless the first message asks
        for another `response_format`), then one JSON message: done (with the latencies seen here) or
        an error. docs/gateway.md has the protocol."""
        await websocket.accept()
        # The key: the Authorization header, or (a browser cannot set it) the first message's api_key.
        authorized = not api_key or key_matches(bearer_token(websocket.headers.get("authorization")), api_key)
        pieces: asyncio.Queue = asyncio.Queue()  # (text, end)
        problems: list[SpeechError] = []  # a bad later message, or the client gone
        loop = asyncio.get_running_loop()

        async def receive(first: bool) -> tuple[str, bool, dict]:
            try:
                message = json.loads(await websocket.receive_text())
            except (ValueError, RecursionError, KeyError):  # (KeyError: a binary message)
                raise SpeechError(400, "each message must be a JSON object in a text message") from None
            if first:
                given = message.pop("api_key", None) if isinstance(message, dict) else None
                if not (authorized or key_matches(given, api_key)):
                    raise bad_api_key()
            piece = parse_text_piece(message, first)
            if piece[1]:
                times["last_piece"] = loop.time()
            return piece

        async def text():
            while True:
                piece, end = await pieces.get()
                yield piece
                if end:
                    return

        async def read_rest(end: bool, stream: SpeechStream) -> None:
            """Later messages, into `pieces`, until the client leaves; one after the last piece, or
            a bad one, ends the stream with its error."""
            while True:
                try:
                    if end:
                        await receive(first=False)
                        raise SpeechError(400, "end: no message may follow the last piece", "end")
                    piece, end, _ = await receive(first=False)
                except Exception as error:  # the stream ends with it (else it waits for text)
                    if isinstance(error, WebSocketDisconnect):
                        error = SpeechError(499, "the client went away")
                    elif not isinstance(error, SpeechError):
                        log.exception("gateway: reading a text stream failed")
                        error = SpeechError(500, f"internal error: {error}", kind="server_error")
                    problems.append(error)
                    stream.cancel()
                    return
                if piece or end:  # an empty piece would cost the server a request for nothing
                    pieces.put_nowait((piece, end))

        times: dict[str, float] = {}  # event-loop times: first and last piece in, first and last audio out

        async def receive_first() -> tuple[str, bool, dict]:
            try:
                return await asyncio.wait_for(receive(first=True), FIRST_MESSAGE_TIMEOUT_S)
            except TimeoutError:  # a socket opened and left: it holds a connection, with a key unchecked
                raise SpeechError(408, f"no first message within {FIRST_MESSAGE_TIMEOUT_S:g} s") from None

        async def speak(piece: str, end: bool, options: dict):
            times["first_piece"] = loop.time()
            pieces.put_nowait((piece, end))
            encoder = new_encoder(options.pop("format"))
            stream = SpeechStream(
                lambda on_chunk: backend.synthesize_text_stream(text(), on_chunk=on_chunk, **options)
            )
            reader = asyncio.create_task(read_rest(end, stream))
            try:
                async for chunk in stream.chunks():
                    if data := await encoded(encoder, encoder.encode, chunk.audio):
                        await websocket.send_bytes(data)
                        times.setdefault("first_audio", loop.time())
                        times["last_audio"] = loop.time()
                failure = problems[0] if problems else stream.failure
                if failure is not None:
                    await websocket.send_json({"type": "error", **failure.body()})
                else:
                    if tail := await encoded(encoder, encoder.finish):
                        await websocket.send_bytes(tail)
                    await websocket.send_json({"type": "speech.audio.done", **stream_latencies(times)})
                with contextlib.suppress(RuntimeError):  # the client closed first (the reader saw it)
                    await websocket.close(code=close_code(failure))
            except WebSocketDisconnect:  # the client went away: stop generating for it
                pass
            except Exception as error:  # the socket still ends with its last message, an error
                log.exception("gateway: a WebSocket stream failed")
                failure = SpeechError(500, f"internal error: {error}", kind="server_error")
                with contextlib.suppress(Exception):  # the client may be gone too
                    await websocket.send_json({"type": "error", **failure.body()})
                    await websocket.close(code=close_code(failure))
            finally:
                stream.cancel()
                reader.cancel()

        try:
            if busy := awaiting_first.busy():  # sockets with their key unchecked hold no more than this
                raise busy
            with awaiting_first.slot():
                piece, end, options = await receive_first()
            if busy := open_limit.busy():
                raise busy
        except WebSocketDisconnect:
            return
        except Exception as error:  # a bad first message, a busy gateway, or a bug: said, then closed
            if not isinstance(error, SpeechError):
                log.exception("gateway: reading a text stream's first message failed")
                error = gateway_failed()
            await websocket.send_json({"type": "error", **error.body()})
            await websocket.close(code=close_code(error))
            return
        with open_limit.slot():
            await speak(piece, end, options)

    return app


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="the voxtriton server's Triton gRPC address, or a proxy's in front of several "
        "(default 127.0.0.1:8001)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes it (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    parser.add_argument(
        "--checkpoint",
        help="checkpoint directory whose voices /v1/models lists (default: the one the backend "
        "serves, read from this host's disk; give it when the backend runs elsewhere)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        metavar="KEY",
        help=f"require this key from clients: the header 'Authorization: Bearer KEY' on /v1/ requests, "
        f"or the first message's api_key on the text-stream WebSocket (default: ${API_KEY_ENV}; none: open)",
    )
    parser.add_argument(
        "--voices-dir",
        default="",
        help="registered voices of a Base checkpoint, shared with the servers' voices_dir "
        "(default: <cache>/voices)",
    )
    parser.add_argument(
        "--max-voices",
        type=int,
        default=TTSSettings.max_voices,
        metavar="N",
        help="refuse a new voice past N in --voices-dir, as the servers' max_voices "
        f"(default {TTSSettings.max_voices})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help="/v1/ requests and text-stream WebSockets open at once; past N a 503 (server_busy), so that "
        f"clients that never read cannot exhaust the gateway's memory (default {MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        metavar="S",
        help="a request body not all received in S seconds gets a 408, so a client that never ends "
        f"its upload cannot hold a --max-connections place (default {BODY_TIMEOUT_S:g})",
    )


def run_gateway(args: argparse.Namespace) -> int:
    import importlib.util

    import uvicorn

    if not any(importlib.util.find_spec(name) for name in ("websockets", "wsproto")):
        log.warning(
            "uvicorn has no WebSocket library here, so WS /v1/audio/speech/stream refuses connections: "
            "pip install websockets to serve it"
        )

    if len(args.backend) > 1:
        raise SystemExit(
            "voxtriton gateway: give one --backend; to use several servers, put a proxy in front of them "
            "(deploy/envoy/, docs/deploy.md) and give its address"
        )
    for flag, value in (("--max-voices", args.max_voices), ("--max-connections", args.max_connections)):
        if value < 1:
            raise SystemExit(f"voxtriton gateway: {flag}: must be at least 1, got {value}")
    if not args.body_timeout > 0:
        raise SystemExit(f"voxtriton gateway: --body-timeout: must be more than 0, got {args.body_timeout:g}")
    app = create_app(
        args.backend[0] if args.backend else "127.0.0.1:8001",
        args.checkpoint,
        args.voices_dir,
        args.api_key,
        args.max_voices,
        args.max_connections,
        args.body_timeout,
    )
    base = f"http://{args.host}:{args.port}"
    print(
        f"voxtriton gateway: {base}/ (playground), POST {base}/v1/audio/speech, GET {base}/v1/models"
        + ("; /v1/ needs the API key" if args.api_key else ""),
        flush=True,
    )
    # No per-message compression: a small compressed message could inflate to the size limit.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        ws_max_size=WS_MAX_MESSAGE_BYTES,
        ws_per_message_deflate=False,
    )
    return 0
