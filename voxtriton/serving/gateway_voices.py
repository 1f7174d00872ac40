"""The gateway's registered-voice endpoints (Base checkpoints), beside `POST /v1/audio/speech`.

    POST   /v1/audio/voices         {"name", "audio": base64 file bytes, "text"?, "replace"?} -> 201
    GET    /v1/audio/voices         the registered voices
    DELETE /v1/audio/voices/{name}  remove one

The gateway encodes a recording once (the served checkpoint's encoders, on its own CPU, one
registration at a time, off the event loop) and writes the voice into the voices directory it shares
with the servers, which find it there at the next request naming it in `voice`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime.
import asyncio
import base64
import binascii
import json
from pathlib import Path

from ..errors import RequestError
from ..models.config import CheckpointError, load_config
from .voices import VoiceEncoder, VoiceStore, check_name, register_voice

MAX_BODY_BYTES = 24 << 20  # a 16 MiB recording in base64, and the rest of the JSON
VOICE_FIELDS = ("name", "audio", "text", "replace")


def add_voice_routes(app, served_checkpoint, voices_directory: Path, error_type) -> None:
    """served_checkpoint: async () -> the checkpoint directory; error_type: the gateway's SpeechError."""
    from fastapi import Request

    encoders: dict[Path, VoiceEncoder] = {}
    one_at_a_time = asyncio.Lock()

    def refused(error: RequestError):
        return error_type(400, str(error), error.field)

    async def voices() -> tuple[Path, VoiceStore]:
        directory = await served_checkpoint()
        try:
            config = load_config(directory)
        except (OSError, CheckpointError) as error:
            raise error_type(503, f"the served checkpoint is not readable here ({error}); give --checkpoint")
        if not config.clones_voices:
            raise error_type(
                400, f"voices: the served checkpoint is {config.model_type}; voices need a Base one"
            )
        return directory, VoiceStore(voices_directory, config)

    @app.post("/v1/audio/voices", status_code=201)
    async def add_voice(request: Request):
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise error_type(413, f"request body too large (at most {MAX_BODY_BYTES} bytes)", "audio")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
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
            raw = base64.b64decode(
                audio.split(",", 1)[1] if audio.startswith("data:") else audio, validate=True
            )
        except binascii.Error:
            raise error_type(400, "audio: not valid base64", "audio") from None
        except RequestError as error:
            raise refused(error) from None
        directory, store = await voices()
        async with one_at_a_time:
            try:
                if directory not in encoders:
                    encoders[directory] = await asyncio.to_thread(VoiceEncoder, directory, store.config)
                return await asyncio.to_thread(
                    register_voice, store, encoders[directory], name, raw, text, body.get("replace", False)
                )
            except RequestError as error:
                raise refused(error) from None

    @app.get("/v1/audio/voices")
    async def list_voices():
        _, store = await voices()
        return {"object": "list", "data": [store.describe(name) for name in store.names()]}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str):
        try:
            check_name(name)
        except RequestError as error:
            raise refused(error) from None
        _, store = await voices()
        if not store.delete(name):
            raise error_type(404, f"name: no voice {name!r}", "name", "not_found_error")
        return {"name": name, "deleted": True}
