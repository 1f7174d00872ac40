"""Turn the inputs of one `tts` request into an engine Request, or a RequestError naming the field;
one parser per model family (`request_parser`).

Triton already checks declared datatypes and shapes against config.pbtxt; this checks values.
"""

from __future__ import annotations

import numpy as np

from ..engine.request import GenerationParams, Request
from ..errors import RequestError
from ..models.config import Qwen3TTSConfig
from ..models.csm.prompt import parse_speaker
from ..models.family import ModelFamily, SamplingDefaults
from ..models.text import PromptBuilder, PromptHead
from ..models.voice import Voice
from .settings import TTSSettings
from .voices import MAX_TRANSCRIPT_BYTES, UNKNOWN_VOICE, VoiceStore

STRING_INPUTS = ("text", "speaker", "language", "instruct", "reference_text")
BYTES_INPUTS = ("reference_audio",)  # a recording's file bytes, decoded by the voice encoder
SCALAR_INPUTS = {
    "seed": np.int64,
    "max_frames": np.int32,
    "ignore_eos": np.bool_,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "repetition_penalty": np.float32,
    "start_frames": np.int32,
}


def _single(name: str, array: np.ndarray):
    if array.size != 1:
        raise RequestError(name, f"expected exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _string(name: str, array: np.ndarray, limit: int) -> str:
    value = _single(name, array)
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, (bytes, np.bytes_)):
        raw = bytes(value)
    else:
        raise RequestError(name, f"expected a BYTES string, got {type(value).__name__}")
    if len(raw) > limit:
        raise RequestError(name, f"too long: {len(raw)} bytes (limit {limit})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(name, f"not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if "\x00" in text:
        raise RequestError(name, "contains a NUL character")
    return text


class RequestParser:
    def __init__(
        self,
        config: Qwen3TTSConfig,
        prompts: PromptBuilder,
        settings: TTSSettings,
        voices: VoiceStore | None = None,
    ):
        """voices: where a Base model looks up the registered voice a request names in `speaker`."""
        self.config, self.prompts, self.settings, self.voices = config, prompts, settings, voices
        self.default_speaker = settings.default_speaker or (prompts.speakers[0] if prompts.speakers else "")
        if self.default_speaker and self.default_speaker.lower() not in config.talker.speakers:
            raise ValueError(
                f"default_speaker {settings.default_speaker!r} is not a speaker of this checkpoint"
            )

    def reference(self, inputs: dict[str, np.ndarray]) -> tuple[bytes, str | None] | None:
        """A request's reference recording (file bytes, not decoded yet) and transcript, or None when
        it brings none. Checks what can be checked before the voice encoder decodes the audio."""
        if "reference_audio" not in inputs:
            if "reference_text" in inputs:
                raise RequestError("reference_text", "given without reference_audio")
            return None
        self._whole_text(inputs)  # not worth an encoding if `parse` refuses it
        audio = _reference_audio(inputs, self.settings)
        if not self.config.clones_voices:
            raise RequestError(
                "reference_audio",
                f"voice cloning needs a Base checkpoint; this one is {self.config.model_type}",
            )
        if "speaker" in inputs and _string("speaker", inputs["speaker"], self.settings.max_text_bytes):
            raise RequestError("speaker", "give a registered voice or reference_audio, not both")
        text = None
        if "reference_text" in inputs:  # held to a registered voice's transcript limit
            text = _string("reference_text", inputs["reference_text"], MAX_TRANSCRIPT_BYTES).strip()
        return audio, text or None

    def registered_voice(self, name: str) -> Voice:
        voice = self.voices.find(name.lower()) if self.voices is not None else None
        if voice is None:
            known = ", ".join(self.voices.names()) if self.voices is not None else ""
            raise RequestError("speaker", f"{UNKNOWN_VOICE} {name!r}; registered: {known or 'none'}")
        return voice

    def _whole_text(self, inputs: dict[str, np.ndarray]) -> str:
        """A whole-text request's text, refusing what only an input stream's first piece takes."""
        if "text" not in inputs:
            raise RequestError("text", "is required")
        text = self.piece_text(inputs)
        if not text.strip():
            raise RequestError("text", "is empty")
        if "start_frames" in inputs:
            raise RequestError(
                "start_frames",
                "only an input stream takes it (a sequence's first piece): a whole text's audio starts "
                "with the schedule's first chunk",
            )
        return text

    def parse(self, request_id: str, inputs: dict[str, np.ndarray], voice: Voice | None = None) -> Request:
        """The engine request; `voice`: the one encoded from the request's reference_audio."""
        text = self._whole_text(inputs)
        _, head, scalars = self._voice(inputs, voice)
        text_ids = self.prompts.tokenizer.encode(text)
        if not text_ids:
            raise RequestError("text", "is empty")
        prompt = head.prompt(text_ids, interleaved=self.settings.text_layout == "interleaved")
        limit = self.settings.max_text_tokens
        if len(text_ids) > limit:
            raise RequestError("text", f"too long: more than {limit} tokens")
        if len(prompt.trailing_text_ids) > limit:  # an in-context voice's transcript leads the text
            raise RequestError("reference_text", f"too long: with the text, over {limit} tokens to feed")
        return Request(request_id, prompt, self._params(scalars, len(prompt.text_ids)))

    def parse_stream(
        self, inputs: dict[str, np.ndarray]
    ) -> tuple[PromptHead, GenerationParams, str, int | None]:
        """The first piece of an input stream: its prompt head, its parameters (for a prompt of the head
        and one text id: the interleaved layout), its text and its `start_frames` (None: the server's).
        A cloned voice is a registered one."""
        for name in ("reference_audio", "reference_text"):
            if name in inputs:
                raise RequestError(
                    name, "not taken on an input stream; register the voice and name it in 'speaker'"
                )
        strings, head, scalars = self._voice(inputs)
        head.check_streamable()
        start_frames = scalars.get("start_frames")
        if start_frames is not None and start_frames < 1:
            raise RequestError("start_frames", f"must be at least 1, got {start_frames}")
        params = self._params(scalars, len(head.text_side) + 1)
        return head, params, strings.get("text", ""), start_frames

    def piece_text(self, inputs: dict[str, np.ndarray]) -> str:
        """The text of a later piece of an input stream (may be empty)."""
        return _string("text", inputs["text"], self.settings.max_text_bytes) if "text" in inputs else ""

    def _voice(
        self, inputs: dict[str, np.ndarray], voice: Voice | None = None
    ) -> tuple[dict[str, str], PromptHead, dict]:
        """The request's strings, its prompt head (voice options checked) and its scalar inputs. voice:
        one encoded from the request's reference_audio; else a Base model's `speaker` names a
        registered one."""
        limit = self.settings.max_text_bytes
        strings = {name: _string(name, inputs[name], limit) for name in STRING_INPUTS if name in inputs}
        scalars = _scalars(inputs)
        speaker = strings.get("speaker") or (
            self.default_speaker if self.config.model_type == "custom_voice" else None
        )
        if voice is None and speaker and self.config.clones_voices:
            voice, speaker = self.registered_voice(speaker), None
        language, instruct = strings.get("language") or None, strings.get("instruct") or None
        return strings, self.prompts.head(speaker, language, instruct, voice), scalars

    def _params(self, scalars: dict, prompt_length: int) -> GenerationParams:
        return _generation_params(self.config.generation, self.settings, scalars, prompt_length)


class CsmRequestParser:
    """A CSM request: its text, who speaks it and sampling values; every field CSM does not take is
    refused naming it (`ModelFamily.refused`). CSM reads its text whole: no input streams.

    `speaker` is a speaker id, or a registered voice's name (a context turn spoken as speaker 0). A
    request's `reference_audio` with its required `reference_text` becomes a context turn spoken by
    the request's speaker id."""

    def __init__(self, family: ModelFamily, settings: TTSSettings, voices: VoiceStore | None = None):
        self.family, self.settings, self.voices = family, settings, voices

    def reference(self, inputs: dict[str, np.ndarray]) -> tuple[bytes, str] | None:
        """A request's context recording (file bytes, decoded by the voice encoder) and its words."""
        self.family.check_fields(set(inputs))
        if "reference_audio" not in inputs:
            if "reference_text" in inputs:
                raise RequestError("reference_text", "given without reference_audio")
            return None
        audio = _reference_audio(inputs, self.settings)
        limit = self.settings.max_text_bytes
        if "speaker" in inputs:
            parse_speaker(_string("speaker", inputs["speaker"], limit))  # an id: who speaks the context
        text = (
            _string("reference_text", inputs["reference_text"], limit) if "reference_text" in inputs else ""
        )
        if not text.strip():
            raise RequestError(
                "reference_text",
                "is required with reference_audio: CSM's context turn needs the recording's words",
            )
        return audio, text.strip()

    def parse(self, request_id: str, inputs: dict[str, np.ndarray], voice: Voice | None = None) -> Request:
        """The engine request; `voice`: the context turn encoded from the request's reference_audio."""
        self.family.check_fields(set(inputs))
        if "text" not in inputs:
            raise RequestError("text", "is required")
        limit = self.settings.max_text_bytes
        text = _string("text", inputs["text"], limit)
        if not text.strip():
            raise RequestError("text", "is empty")
        speaker = _string("speaker", inputs["speaker"], limit) if "speaker" in inputs else None
        if voice is None and speaker and not speaker.isdecimal() and self.voices is not None:
            voice, speaker = self._registered_voice(speaker.lower()), None
        prompt, limit = self.family.prompt.prompt(text, speaker, voice), self.settings.max_text_tokens
        if prompt.text_tokens > limit:
            if voice is None or self.family.prompt.prompt(text, speaker).text_tokens > limit:
                raise RequestError("text", f"too long: more than {limit} tokens")
            # The context turn's words lead the text: the recording's transcript, or the voice's.
            field = "reference_text" if "reference_text" in inputs else "speaker"
            raise RequestError(field, f"too long: its words with the text are over {limit} tokens")
        params = _generation_params(
            self.family.sampling, self.settings, _scalars(inputs), len(prompt.text_ids)
        )
        return Request(request_id, prompt, params)

    def _registered_voice(self, name: str) -> Voice:
        voice = self.voices.find(name)
        if voice is None:
            registered = ", ".join(self.voices.names()) or "none"
            raise RequestError(
                "speaker",
                f"{UNKNOWN_VOICE} {name!r}: not a speaker id (a non-negative integer such as 0 or 1) "
                f"nor a registered voice; registered: {registered}",
            )
        return voice

    def parse_stream(self, inputs: dict[str, np.ndarray]):
        raise RequestError(
            "text", "CSM reads its text whole: send it in one request, not as an input stream (sequence)"
        )


def request_parser(family: ModelFamily, settings: TTSSettings, voices: VoiceStore | None = None):
    """The parser of the family's requests (`voices`: the registered voices of a model that clones)."""
    if family.name == "csm":
        return CsmRequestParser(family, settings, voices)
    return RequestParser(family.config, family.prompt, settings, voices)


def _reference_audio(inputs: dict[str, np.ndarray], settings: TTSSettings) -> bytes:
    """A request's reference recording: one BYTES value within the size limit (decoded later)."""
    audio = _single("reference_audio", inputs["reference_audio"])
    if not isinstance(audio, (bytes, np.bytes_)):
        raise RequestError("reference_audio", f"expected BYTES (a file's bytes), got {type(audio).__name__}")
    if len(audio) > settings.max_reference_bytes:
        raise RequestError(
            "reference_audio", f"too large: {len(audio)} bytes (limit {settings.max_reference_bytes})"
        )
    return bytes(audio)


def _scalars(inputs: dict[str, np.ndarray]) -> dict:
    return {name: _single(name, inputs[name]).item() for name in SCALAR_INPUTS if name in inputs}


def _generation_params(
    defaults: SamplingDefaults | dict, settings: TTSSettings, scalars: dict, prompt_length: int
) -> GenerationParams:
    frames_limit = min(settings.max_frames, settings.max_positions - prompt_length)
    if frames_limit < 1:
        raise RequestError("text", "too long for the server's KV cache (max_positions)")
    # GenerationParams.create checks every sampling value and max_frames against frames_limit.
    return GenerationParams.create(
        defaults,
        frames_limit,
        temperature=scalars.get("temperature"),
        top_k=scalars.get("top_k"),
        top_p=scalars.get("top_p"),
        repetition_penalty=scalars.get("repetition_penalty"),
        seed=scalars.get("seed"),
        max_frames=scalars.get("max_frames"),
        ignore_eos=bool(scalars.get("ignore_eos", False)),
    )
