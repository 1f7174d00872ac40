"""Turn the inputs of one `tts` request into an engine Request, or a RequestError naming the field;
one parser per model family (`request_parser`).

Triton already checks declared datatypes and shapes against config.pbtxt; this checks values.
"""

from __future__ import annotations

import numpy as np

from ..engine.request import GenerationParams, Request
from ..errors import RequestError
from ..models.config import Qwen3TTSConfig
from ..models.family import ModelFamily, SamplingDefaults
from ..models.text import PromptBuilder, PromptHead
from ..models.voice import Voice
from .settings import TTSSettings
from .voices import VoiceStore

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
        audio = _single("reference_audio", inputs["reference_audio"])
        if not isinstance(audio, (bytes, np.bytes_)):
            raise RequestError(
                "reference_audio", f"expected BYTES (a file's bytes), got {type(audio).__name__}"
            )
        if len(audio) > self.settings.max_reference_bytes:
            raise RequestError(
                "reference_audio",
                f"too large: {len(audio)} bytes (limit {self.settings.max_reference_bytes})",
            )
        if not self.config.clones_voices:
            raise RequestError(
                "reference_audio",
                f"voice cloning needs a Base checkpoint; this one is {self.config.model_type}",
            )
        if "speaker" in inputs and _string("speaker", inputs["speaker"], self.settings.max_text_bytes):
            raise RequestError("speaker", "give a registered voice or reference_audio, not both")
        text = None
        if "reference_text" in inputs:
            text = _string("reference_text", inputs["reference_text"], self.settings.max_text_bytes).strip()
        return bytes(audio), text or None

    def registered_voice(self, name: str) -> Voice:
        voice = self.voices.get(name.lower()) if self.voices is not None else None
        if voice is None:
            known = ", ".join(self.voices.names()) if self.voices is not None else ""
            raise RequestError(
                "speaker", f"unknown voice {name!r}; registered: {known or 'none'} (or send reference_audio)"
            )
        return voice

    def parse(self, request_id: str, inputs: dict[str, np.ndarray], voice: Voice | None = None) -> Request:
        """The engine request; `voice`: the one encoded from the request's reference_audio."""
        if "text" not in inputs:
            raise RequestError("text", "is required")
        text = self.piece_text(inputs)
        if not text.strip():
            raise RequestError("text", "is empty")
        _, head, scalars = self._voice(inputs, voice)
        text_ids = self.prompts.tokenizer.encode(text)
        if not text_ids:
            raise RequestError("text", "is empty")
        prompt = head.prompt(text_ids, interleaved=self.settings.text_layout == "interleaved")
        reference_frames = 0 if prompt.reference_codes is None else len(prompt.reference_codes)
        if (
            len(prompt.trailing_text_ids) > self.settings.max_text_tokens
            or len(prompt.text_ids) - reference_frames > self.settings.max_text_tokens
        ):
            raise RequestError("text", f"too long: more than {self.settings.max_text_tokens} tokens")
        return Request(request_id, prompt, self._params(scalars, len(prompt.text_ids)))

    def parse_stream(self, inputs: dict[str, np.ndarray]) -> tuple[PromptHead, GenerationParams, str]:
        """The first piece of an input stream: its prompt head, its parameters (for a prompt of the head
        and one text id: the interleaved layout) and its text. A cloned voice is a registered one."""
        for name in ("reference_audio", "reference_text"):
            if name in inputs:
                raise RequestError(
                    name, "not taken on an input stream; register the voice and name it in 'speaker'"
                )
        strings, head, scalars = self._voice(inputs)
        return head, self._params(scalars, len(head.text_side) + 1), strings.get("text", "")

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
    """A CSM request: its text, a speaker id and sampling values; every field CSM does not take is
    refused naming it (`ModelFamily.refused`). CSM reads its text whole: no input streams."""

    def __init__(self, family: ModelFamily, settings: TTSSettings):
        self.family, self.settings = family, settings

    def reference(self, inputs: dict[str, np.ndarray]) -> None:
        self.family.check_fields(set(inputs))  # a recording to clone is refused here, naming its field

    def parse(self, request_id: str, inputs: dict[str, np.ndarray], voice: Voice | None = None) -> Request:
        self.family.check_fields(set(inputs))
        if "text" not in inputs:
            raise RequestError("text", "is required")
        limit = self.settings.max_text_bytes
        text = _string("text", inputs["text"], limit)
        if not text.strip():
            raise RequestError("text", "is empty")
        speaker = _string("speaker", inputs["speaker"], limit) if "speaker" in inputs else None
        prompt = self.family.prompt.prompt(text, speaker)
        if prompt.text_tokens > self.settings.max_text_tokens:
            raise RequestError("text", f"too long: more than {self.settings.max_text_tokens} tokens")
        params = _generation_params(
            self.family.sampling, self.settings, _scalars(inputs), len(prompt.text_ids)
        )
        return Request(request_id, prompt, params)

    def parse_stream(self, inputs: dict[str, np.ndarray]):
        raise RequestError(
            "text", "CSM reads its text whole: send it in one request, not as an input stream (sequence)"
        )


def request_parser(family: ModelFamily, settings: TTSSettings, voices: VoiceStore | None = None):
    """The parser of the family's requests (`voices`: a Qwen3-TTS Base model's registered voices)."""
    if family.name == "csm":
        return CsmRequestParser(family, settings)
    return RequestParser(family.config, family.prompt, settings, voices)


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
