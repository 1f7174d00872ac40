"""The gateway's voice endpoints, beside `POST /v1/audio/speech`, for the served model's family.

    POST   /v1/audio/voices         {"name", "audio": base64 file bytes, "text"?, "replace"?} -> 201
    GET    /v1/audio/voices         the model's speakers, then the registered voices
    DELETE /v1/audio/voices/{name}  remove one

Only a model that clones voices (a Qwen3-TTS Base checkpoint, CSM) registers them; for any other
the list is its speakers and a registration is refused, naming that the model takes no reference
audio.

The gateway encodes a recording once (the served checkpoint's encoders, on its own CPU, one
registration at a time, off the event loop) and writes the voice into the voices directory it shares
with the servers, which find it there at the next request naming it in `voice`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime.
import asyncio
import base64
import binascii
import json
import secrets
from pathlib import Path

from ..errors import RequestError, utf8
from ..models.config import CheckpointError
from ..models.families import load_family
from ..models.family import ModelFamily
from .voices import VoiceEncoder, VoiceStore, check_name, encode_voice

MAX_BODY_BYTES = 24 << 20  # a 16 MiB recording in base64, and the rest of the JSON
# A request's whole body (the gateway's --body-timeout): one that never ends would hold its
# open-requests slot for good.
BODY_TIMEOUT_S = 60.0
# Registrations waiting for the one being encoded (seconds each on a CPU), each holding its body.
MAX_WAITING_REGISTRATIONS = 2


async def read_body(request, limit: int, error_type, timeout_s: float) -> bytes:
    """The request's body, refused with a 413 past `limit` bytes whether or not it declares its
    length (a chunked upload does not), and with a 408 if it has not all come in `timeout_s`."""
    from starlette.requests import ClientDisconnect

    too_large = error_type(413, f"request body too large (at most {limit} bytes)")
    if int(request.headers.get("content-length") or 0) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise error_type(408, f"request body not received within {timeout_s:g} s") from None
    except ClientDisconnect:  # nobody is left to answer: end the request quietly
        raise error_type(400, "the client went away before its request body ended") from None
    return bytes(body)


VOICE_FIELDS = ("name", "audio", "text", "replace")


def add_voice_routes(
    app,
    served_checkpoint,
    server_finds,
    voices_directory: Path,
    max_voices: int,
    error_type,
    body_timeout_s: float,
):
    """served_checkpoint: async () -> the checkpoint directory; server_finds: async (name) -> whether
    the server finds that voice (None: it could not tell); max_voices: as the servers' `max_voices`;
    error_type: the gateway's SpeechError; body_timeout_s: as `read_body`'s.
    Returns `store_of(family)`: the voice store of a checkpoint, one per checkpoint for the gateway's
    life, so a listing reads only the voice files that changed since the last (in a worker thread:
    never on the event loop)."""
    from fastapi import Request

    encoders: dict[Path, VoiceEncoder] = {}
    stores: dict[Path, VoiceStore] = {}
    one_at_a_time = asyncio.Lock()
    registrations = 0  # running or waiting

    def store_of(family: ModelFamily) -> VoiceStore:
        if family.checkpoint not in stores:
            stores[family.checkpoint] = VoiceStore(voices_directory, family, max_voices)
        return stores[family.checkpoint]

    def refused(error: RequestError):
        return error_type(400, str(error), error.field)

    async def served_family() -> ModelFamily:
        directory = await served_checkpoint()
        try:
            return load_family(directory)
        except (OSError, CheckpointError) as error:  # the gateway's setup: a retry would not help
            raise error_type(
                500,
                f"the served checkpoint is not readable here ({error}); give --checkpoint",
                kind="server_error",
            ) from None

    def clones_none(family: ModelFamily) -> str:
        """Why a model that clones no voice has no registered ones, in words."""
        reason = family.refused.get("reference_audio", "it clones no voice")
        speakers = f"; its speakers: {', '.join(family.speakers)}" if family.speakers else ""
        return f"the served model takes no reference audio, so it registers no voices ({reason}){speakers}"

    @app.post("/v1/audio/voices", status_code=201)
    async def add_voice(request: Request):
        nonlocal registrations
        family = await served_family()  # a model that clones none is refused whatever the body
        if not family.clones_voices:
            raise error_type(400, "audio: " + clones_none(family), "audio")
        if registrations > MAX_WAITING_REGISTRATIONS:  # refused before its body is read
            raise error_type(
                503, "The gateway is registering other voices; retry shortly.", kind="server_busy"
            )
        registrations += 1
        try:
            return await register(request, family)
        finally:
            registrations -= 1

    shared = False  # a server has found a voice this gateway wrote

    async def check_shared(store: VoiceStore, voice) -> None:
        """A voice written where no server reads it would be a 201 here and "unknown voice" at every
        use (the directories differ, or this host shares none with the servers'). Until a server has
        found one, each registration first writes its voice under a name of its own, asks a server
        for one frame in it and deletes it: only an answer that the server knows no such voice
        refuses it (a server busy, unreachable or slow leaves the question open)."""
        nonlocal shared
        if shared:
            return
        probe = f"gateway-probe-{secrets.token_hex(8)}"
        await asyncio.to_thread(store.add, probe, voice, counted=False)
        try:
            found = await server_finds(probe)
        finally:
            await asyncio.to_thread(store.delete, probe)
        if found is False:
            raise error_type(
                500,
                f"the server does not find the voices this gateway writes in {voices_directory}: give "
                "the gateway --voices-dir as the servers' voices_dir, on a directory they share; "
                "nothing was registered",
                kind="server_error",
            )
        shared = found is True

    async def register(request, family: ModelFamily) -> dict:
        directory, store = family.checkpoint, store_of(family)
        try:
            body = json.loads(await read_body(request, MAX_BODY_BYTES, error_type, body_timeout_s))
        except (ValueError, RecursionError):  # not JSON or UTF-8, or numbers or nesting past Python's limits
            raise error_type(400, "request body must be JSON") from None
        if not isinstance(body, dict):
            raise error_type(400, "request body must be a JSON object")
        unknown = [name for name in body if name not in VOICE_FIELDS]
        if unknown:
            raise error_type(
                400, f"{unknown[0]}: unknown field; supported: {', '.join(VOICE_FIELDS)}", unknown[0]
            )
        name, audio, text = body.get("name"), body.get("audio"), body.get("text")
        if not isinstance(name, str):
            raise error_type(400, "name: must be a string", "name")
        if not isinstance(audio, str):
            raise error_type(400, "audio: must be the recording's file bytes in base64", "audio")
        if text is not None and not isinstance(text, str):
            raise error_type(400, "text: must be a string", "text")
        if not isinstance(body.get("replace", False), bool):
            raise error_type(400, "replace: must be true or false", "replace")
        try:
            check_name(name)
            utf8(text or "", "text")  # before the recording is encoded
            raw = base64.b64decode(
                audio.partition(",")[2] if audio.startswith("data:") else audio, validate=True
            )
        except binascii.Error:
            raise error_type(400, "audio: not valid base64", "audio") from None
        except RequestError as error:
            raise refused(error) from None
        async with one_at_a_time:
            try:
                if directory not in encoders:
                    encoders[directory] = await asyncio.to_thread(VoiceEncoder, family)
                voice = await asyncio.to_thread(encode_voice, encoders[directory], name, raw, text)
                await check_shared(store, voice)
                await asyncio.to_thread(store.add, name, voice, replace=body.get("replace", False))
                return await asyncio.to_thread(store.describe, name)
            except RequestError as error:
                raise refused(error) from None

    @app.get("/v1/audio/voices")
    async def list_voices():
        family = await served_family()
        speakers = [{"name": name, "speaker": True} for name in family.speakers]
        if not family.clones_voices:
            return {"object": "list", "data": speakers}
        return {"object": "list", "data": speakers + await asyncio.to_thread(store_of(family).descriptions)}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        try:
            check_name(name)
        except RequestError as error:
            raise refused(error) from None
        family = await served_family()
        if not family.clones_voices:
            message = f"name: no voice {name!r}: {clones_none(family)}"
            raise error_type(404, message, "name", "not_found_error")
        if not await asyncio.to_thread(store_of(family).delete, name):
            raise error_type(404, f"name: no voice {name!r}", "name", "not_found_error")
        return {"name": name, "deleted": True}

    return store_of
