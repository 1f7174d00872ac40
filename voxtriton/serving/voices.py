"""Cloned voices: encoded from reference recordings, stored, looked up by name.

- `VoiceEncoder` runs a Qwen3-TTS Base checkpoint's speaker encoder (x-vector) and speech-tokenizer
  encoder (reference codes), or a CSM checkpoint's Mimi encoder (the codes of a context turn, whose
  transcript is then required), on one device; a pass's recordings as one batch (CUDA graphs on a
  server's GPU).
- `EncodingQueue` is the `tts` model's encoder thread: requests that bring `reference_audio` wait
  there, not on Triton's execute thread nor on the engine thread, and go on to the engine once
  their voice is encoded. Recordings that arrive together are encoded together; the voices of the
  latest ones are kept by their bytes and transcript, so a reference sent again is not encoded
  again (and an in-context one's primed codec state is kept, under its codes' key).
- `VoiceStore` keeps registered voices in a directory, one `<name>.npz` per voice (x-vector, empty
  for CSM, reference codes, transcript). A name is checked against NAME before it becomes a file
  name, so no request can name a path. Each lookup compares the file's size and modification time with the
  cached copy: a voice added or deleted while the server runs is seen at its next request.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..engine.encoder_runner import EncoderRunner
from ..errors import RequestError, ServerBusy, utf8
from ..models.family import ModelFamily
from ..models.voice import Voice, codes_key
from .reference_audio import read_reference_audio

log = logging.getLogger(__name__)

NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
MAX_TRANSCRIPT_BYTES = 4096
# In a server's error for a voice its directory does not hold (a gateway looks for it).
UNKNOWN_VOICE = "unknown voice"


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(
            field,
            f"{name!r} is not a voice name (1 to 64 of a-z, 0-9, '_', '-'; a letter or digit first)",
        )
    return name


class VoiceEncoder:
    """Reference waveforms (24 kHz) -> Voices, on `device`, in fp32."""

    def __init__(self, family: ModelFamily, device: torch.device | str = "cpu", graphs: bool = False):
        """graphs: run the encoders as CUDA graphs (a server; a one-off encode need not wait for
        their capture)."""
        self.device = torch.device(device)
        speaker_encoder, speech_encoder = family.load_voice_encoders(self.device)
        self.context_turn = speaker_encoder is None  # CSM: a voice is a context turn
        self.codebooks = family.codebooks
        # Beside the engine's streams, so a batch of recordings does not queue behind frame steps; one
        # stream per encoder, so an in-context voice's two encoders run at once (each is too small at
        # one recording to fill the GPU).
        cuda = self.device.type == "cuda"
        self.speech_stream = torch.cuda.Stream(self.device) if cuda else None
        self.speaker_stream = torch.cuda.Stream(self.device) if cuda else None
        with _on(self.speech_stream):
            self.speech_encoder = EncoderRunner(
                speech_encoder, lambda codes, samples: codes[: speech_encoder.frames(samples)], graphs=graphs
            )
        self.speaker_encoder = None
        if speaker_encoder is not None:
            with _on(self.speaker_stream):
                self.speaker_encoder = EncoderRunner(
                    speaker_encoder, lambda x_vector, _: x_vector, speaker_encoder.tail_margin, graphs
                )

    def graph_count(self) -> int:
        return sum(len(runner.graphs) for runner in (self.speech_encoder, self.speaker_encoder) if runner)

    @torch.inference_mode()
    def encode(
        self, waveforms: list[np.ndarray], texts: list[str | None], x_vector_codes: bool = True
    ) -> list[Voice]:
        """The recordings go through each encoder as one batch (see `EncoderRunner`).
        `x_vector_codes`: also encode the codes of a recording without a transcript, which its
        x-vector-only prompt does not use (a registered voice keeps them; an inline one gets none)."""
        every_code = x_vector_codes or self.context_turn
        coded = [index for index, text in enumerate(texts) if every_code or text]
        # Both queued before either is read: the two streams overlap.
        with _on(self.speech_stream):
            codes = dict(zip(coded, self.speech_encoder.run([waveforms[i] for i in coded]))) if coded else {}
        with _on(self.speaker_stream):
            embeddings = self.speaker_encoder.run(waveforms) if self.speaker_encoder is not None else None
            embeddings = [embedding.float().cpu().numpy() for embedding in embeddings or []]
        with _on(self.speech_stream):
            codes = {index: code.cpu().numpy().astype(np.int64) for index, code in codes.items()}
        no_embedding, no_codes = np.zeros(0, np.float32), np.zeros((0, self.codebooks), np.int64)
        return [
            Voice(
                embeddings[index] if embeddings else no_embedding,
                codes.get(index, no_codes),
                text or None,
            )
            for index, text in enumerate(texts)
        ]


def _on(stream: torch.cuda.Stream | None):
    """Queue work on `stream`; None (a CPU): as it comes."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class _Job:
    audio: bytes
    text: str | None
    done: Callable[[Voice], None]
    fail: Callable[[str], None]
    answered: bool = False

    def answer(self, voice: Voice) -> None:
        self.answered = True
        self.done(voice)

    def refuse(self, message: str) -> None:
        self.answered = True
        try:
            self.fail(message)
        except Exception:  # its sender failed: nothing more reaches that client, the others go on
            log.exception("a request's error could not be sent")


class EncodingQueue:
    """A thread that encodes queued reference recordings, up to `max_batch` per pass, and hands each
    voice to its job's `done`; a bad recording or a failing `done` goes to the job's `fail`. The
    voices of the last `cache_size` distinct (recording, transcript) pairs are kept. Beyond
    `max_waiting` jobs waiting or in the pass being encoded, `submit` refuses: server busy, as the
    engine's queue does."""

    def __init__(self, encoder: VoiceEncoder, max_batch: int = 8, cache_size: int = 0, max_waiting: int = 64):
        self.encoder, self.max_batch, self.max_waiting = encoder, max_batch, max_waiting
        self.cache_size = cache_size
        self.cache: collections.OrderedDict[tuple[bytes, str | None], Voice] = collections.OrderedDict()
        self.jobs: list[_Job] = []
        self.in_pass = 0  # jobs taken from `jobs` into the pass being encoded and answered
        self.lock = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="voxtriton-voice-encoder", daemon=True)
        self.thread.start()

    def submit(
        self, audio: bytes, text: str | None, done: Callable[[Voice], None], fail: Callable[[str], None]
    ):
        with self.lock:
            if not self.running:  # its thread is gone: the job would never be answered
                raise ServerBusy("server shutting down")
            if len(self.jobs) + self.in_pass >= self.max_waiting:
                raise ServerBusy(
                    f"server busy: {len(self.jobs) + self.in_pass} requests with reference_audio wait "
                    f"for the voice encoder or are in it (at most {self.max_waiting}: max_streams + "
                    "max_queued); retry later"
                )
            self.jobs.append(_Job(audio, text, done, fail))
            self.lock.notify()

    def shutdown(self) -> None:
        with self.lock:
            self.running = False
            jobs, self.jobs = self.jobs, []
            self.lock.notify()
        for job in jobs:
            job.refuse("server shutting down")
        self.thread.join(5)

    def _run(self) -> None:
        while True:
            with self.lock:
                while self.running and not self.jobs:
                    self.lock.wait()
                if not self.running:
                    return
                jobs, self.jobs = self.jobs[: self.max_batch], self.jobs[self.max_batch :]
                self.in_pass = len(jobs)
            try:
                self._encode(jobs)
            except Exception as error:  # a bug: the pass's unanswered requests fail, the thread goes on
                log.exception("voice encoder pass failed")
                for job in jobs:
                    if not job.answered:
                        job.refuse(f"internal error: reference_audio could not be encoded: {error}")
            finally:
                with self.lock:
                    self.in_pass = 0

    def idle(self) -> bool:
        """No request waits for its voice here."""
        with self.lock:
            return not self.jobs and not self.in_pass

    def _encode(self, jobs: list[_Job]) -> None:
        """Answer every job exactly once: its voice to `done`, or an error to `fail`. Kept voices
        first: they need no encoding, so they do not wait for the others'."""
        known, fresh = [], []
        for job in jobs:
            # SHA-256: the CPU's SHA instructions hash 10 s of WAV in half blake2b's time
            key = (hashlib.sha256(job.audio).digest(), job.text) if self.cache_size else None
            if key in self.cache:
                self.cache.move_to_end(key)
                known.append((job, self.cache[key]))
            else:
                fresh.append((job, key))
        self._answer(known)
        ready, waveforms = [], []
        for job, key in fresh:
            try:
                waveforms.append(read_reference_audio(job.audio))
                ready.append((job, key))
            except RequestError as error:
                job.refuse(str(error))
        if not ready:
            return
        try:
            voices = self.encoder.encode(waveforms, [job.text for job, _ in ready], x_vector_codes=False)
        except Exception as error:  # a bug or device fault: fail these requests, keep serving
            log.exception("voice encoder failed")
            for job, _ in ready:
                job.refuse(f"internal error: reference_audio could not be encoded: {error}")
            return
        self._answer([(job, self._keep(key, voice)) for (job, key), voice in zip(ready, voices)])

    @staticmethod
    def _answer(answers: list[tuple[_Job, Voice]]) -> None:
        for job, voice in answers:
            try:
                job.answer(voice)
            except (RequestError, ServerBusy) as error:
                job.refuse(str(error))
            except Exception as error:  # never leave a request without its answer
                log.exception("a request with a cloned voice failed before generation")
                job.refuse(f"internal error: {error}")

    def _keep(self, key: tuple[bytes, str | None] | None, voice: Voice) -> Voice:
        """The voice as kept (an in-context one under its codes' key, so its primed state is kept)."""
        if not self.cache_size:
            return voice
        voice = dataclasses.replace(voice, key=codes_key(voice.codes) if voice.in_context else None)
        self.cache[key] = voice
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return voice


def register_voice(
    store: "VoiceStore",
    encoder: VoiceEncoder,
    name: str,
    audio: bytes,
    text: str | None,
    replace: bool = False,
) -> dict:
    """Encode a recording (file bytes) once and store it as `name`; returns its description."""
    store.add(name, encode_voice(encoder, name, audio, text), replace=replace)
    return store.describe(name)


def encode_voice(encoder: VoiceEncoder, name: str, audio: bytes, text: str | None) -> Voice:
    """The voice a registration as `name` stores: its fields checked, the recording encoded."""
    check_name(name)
    text = (text or "").strip() or None
    if text is not None and len(utf8(text, "text")) > MAX_TRANSCRIPT_BYTES:
        raise RequestError("text", f"too long (at most {MAX_TRANSCRIPT_BYTES} bytes)")
    if encoder.context_turn and text is None:
        raise RequestError("text", "is required: CSM's voice is a context turn, the recording and its words")
    if encoder.context_turn and name.isdecimal():
        raise RequestError("name", f"{name!r} is a CSM speaker id; give a voice a name with a letter")
    return encoder.encode([read_reference_audio(audio, "audio")], [text])[0]


def _exists(name: str) -> RequestError:
    return RequestError("name", f"voice {name!r} exists; delete it first, or replace it")


class VoiceStore:
    """Registered voices of one checkpoint in `directory`, at most `max_voices` of them."""

    def __init__(self, directory: Path, family: ModelFamily, max_voices: int = 1000):
        self.directory, self.family, self.max_voices = Path(directory), family, max_voices
        # name -> ((inode, mtime, size) of the file read, its voice); least recently used first, at
        # most max_voices, so names registered, used and deleted do not pile up. A replaced voice is
        # a new inode (written aside, then linked in), however soon after the old one.
        self.cache: collections.OrderedDict[str, tuple[tuple[int, int, int], Voice]] = (
            collections.OrderedDict()
        )
        self.lock = threading.Lock()

    def _path(self, name: str) -> Path:
        return self.directory / f"{check_name(name)}.npz"

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.stem for p in self.directory.glob("*.npz") if NAME.fullmatch(p.stem))

    def newest(self) -> list[str]:
        """The names, the most recently registered (or replaced) first."""
        if not self.directory.is_dir():
            return []
        registered = {}
        for path in self.directory.glob("*.npz"):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                if NAME.fullmatch(path.stem):
                    registered[path.stem] = path.stat().st_mtime_ns
        return sorted(registered, key=registered.get, reverse=True)

    def add(self, name: str, voice: Voice, replace: bool = False, counted: bool = True) -> None:
        """counted=False: a voice held for a moment (a gateway's probe), past `max_voices` too."""
        path = self._path(name)
        self._check(name, voice)
        exists = path.exists()
        if exists and not replace:
            raise _exists(name)
        if counted and not exists and len(self.names()) >= self.max_voices:
            raise RequestError("name", f"the voices directory is full ({self.max_voices} voices)")
        self.directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                np.savez(
                    file,
                    embedding=voice.embedding.astype(np.float32),
                    codes=voice.codes.astype(np.int16),
                    text=np.frombuffer((voice.text or "").encode("utf-8"), dtype=np.uint8),
                )
            if replace:
                os.replace(temporary, path)  # atomic: a reader sees the old file or the new one
            else:  # atomic too, and refused if another gateway registered the name meanwhile
                try:
                    os.link(temporary, path)
                except FileExistsError:
                    raise _exists(name) from None
                except OSError:  # a file system without hard links: as checked above
                    os.replace(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def delete(self, name: str) -> bool:
        try:
            self._path(name).unlink()
            return True
        except FileNotFoundError:
            return False

    def find(self, name: str) -> Voice | None:
        """The voice a request names, or None: no voice is registered as `name`, or none could be."""
        return self.get(name) if NAME.fullmatch(name) else None

    def get(self, name: str) -> Voice | None:
        """The voice registered as `name`, or None; RequestError for a name that cannot be one."""
        path = self._path(name)
        try:
            stat = path.stat()
        except FileNotFoundError:
            return self._forget(name)
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        with self.lock:
            cached = self.cache.get(name)
            if cached is not None and cached[0] == key:
                self.cache.move_to_end(name)
                return cached[1]
        voice = self._load(name, path)
        if voice is None:
            return self._forget(name)
        with self.lock:
            self.cache[name] = (key, voice)
            self.cache.move_to_end(name)
            if len(self.cache) > self.max_voices:
                self.cache.popitem(last=False)
        return voice

    def _forget(self, name: str) -> None:
        with self.lock:
            self.cache.pop(name, None)

    def _load(self, name: str, path: Path) -> Voice | None:
        """The voice in `path`; None: deleted since it was found."""
        try:
            with np.load(path, allow_pickle=False) as data:
                text = bytes(data["text"]).decode("utf-8") or None
                codes = data["codes"].astype(np.int64)
                voice = Voice(data["embedding"].astype(np.float32), codes, text, codes_key(codes))
        except FileNotFoundError:
            return None
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise RequestError("speaker", f"registered voice {name!r} cannot be read ({error})") from None
        self._check(name, voice, "speaker")
        return voice

    def _check(self, name: str, voice: Voice, field: str = "name") -> None:
        """A voice of this checkpoint: its x-vector width and codebooks match (and a CSM voice has its
        transcript)."""
        family, codes = self.family, voice.codes
        width = family.voice_embedding_width
        if not np.isfinite(voice.embedding).all():
            raise RequestError(field, f"voice {name!r} has an x-vector that is not finite numbers")
        if (
            voice.embedding.shape != (width,)
            or (width == 0 and not voice.text)
            or codes.ndim != 2
            or codes.shape[1] != family.codebooks
            or not 0 < len(codes) <= 30 * family.sample_rate // family.samples_per_frame + 1
            or codes.min() < 0
            or codes.max() >= family.codec_vocab
        ):
            raise RequestError(
                field, f"voice {name!r} was not made for this checkpoint (x-vector or codes differ)"
            )

    def descriptions(self, left_out: Callable[[str, RequestError], None] | None = None) -> list[dict]:
        """The voices made for this checkpoint: a directory shared by several checkpoints (the default
        one) also holds other checkpoints' voices, which are left out here (each told to `left_out`
        with the reason, if given)."""
        found = []
        for name in self.names():
            try:
                description = self.describe(name)
            except RequestError as error:
                if left_out is not None:
                    left_out(name, error)
                continue
            if description is not None:  # None: deleted meanwhile
                found.append(description)
        return found

    def describe(self, name: str) -> dict | None:
        voice = self.get(name)
        if voice is None:
            return None
        seconds = len(voice.codes) / self.family.frame_rate
        return {
            "name": name,
            "seconds": round(seconds, 2),
            "in_context": voice.in_context,
            "text": voice.text,
        }
