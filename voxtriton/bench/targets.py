"""What the load is sent to: voxtriton's tritonservers over gRPC, or any OpenAI-compatible streaming
speech endpoint over HTTP. Both turn one utterance into a RequestResult with the same playback
accounting, so the figures of either path mean the same thing."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from voxtriton_client import simulate_playback

from voxtriton.bench.summary import LANES, MIN_AUDIO_FRACTION, RequestResult
from voxtriton.models.text import TextTokenizer
from voxtriton.serving.gateway import Backend

FRAME_RATE = 12.5  # codec frames per second of audio
PCM_SAMPLE_RATE = 24000  # OpenAI's `pcm`: 16-bit little-endian mono samples at 24 kHz
# voxtriton's gateway runs random weights to the length asked for when told to ignore the end token.
GATEWAY_EXTRA_BODY = {"ignore_eos": True}


@dataclass(frozen=True)
class Utterance:
    text: str
    frames: int  # its fixed length: the model generates exactly this many frames
    seed: int

    @property
    def seconds(self) -> float:
        return self.frames / FRAME_RATE


def played(
    sent: float,
    arrivals: list[tuple[float, float]],
    error: str | None,
    lanes=None,
    asked_s=None,
    text_end_to_audio_end_s=None,
):
    """A RequestResult from the audio's arrivals ((seconds after `sent`, audio seconds) per piece);
    `lanes[i]` names the codec lane of piece i where the server says it. A stream that ends well
    short of the audio asked for did less work than the workload asks of it: it counts as failed."""
    report = simulate_playback(0.0, arrivals)
    if error is None and asked_s and report.audio_s < MIN_AUDIO_FRACTION * asked_s:
        error = f"ended short: {report.audio_s:.2f} s of audio of the {asked_s:.2f} s asked for"
    last = arrivals[-1][0] if arrivals else None
    late = tuple((i, lanes[i] if lanes else "unknown") for i in report.late_chunks)
    return RequestResult(
        sent,
        report.ttfa_s,
        report.stall_s,
        report.audio_s,
        last / report.audio_s if last and report.audio_s else None,
        error,
        late,
        asked_s,
        text_end_to_audio_end_s,
    )


@functools.cache
def tokenizer_of(checkpoint: str) -> TextTokenizer:
    return TextTokenizer(checkpoint)


class TextFrames:
    """A request's length from its text: one frame per text id (the interleaved layout reads one a
    frame) and `tail` more. Picklable, so client processes can take it: a process loads the
    tokenizer once, when the first probe's arguments reach it (before its arrivals start)."""

    def __init__(self, checkpoint: str, tail: int):
        self.checkpoint, self.tail = checkpoint, tail
        self.tokenizer = tokenizer_of(checkpoint)

    def __getstate__(self) -> dict:
        return {"checkpoint": self.checkpoint, "tail": self.tail}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["checkpoint"], state["tail"])

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) + self.tail


async def words_at(text: str, rate: float):
    """The text's words (each with the space before it) at `rate` per second, the first at once: text
    as an LLM produces it, about a token a word."""
    words = text.split(" ")
    for index, word in enumerate(words):
        if index:
            await asyncio.sleep(1.0 / rate)
        yield word if index == 0 else " " + word


class TritonTarget:
    """voxtriton's tritonservers over gRPC; with several, each request goes to the one with the fewest
    requests in flight, ties taking turns, as a proxy's least-request balancing does. A fixed length
    is max_frames with ignore_eos. With `text_rate`, each text streams in (input streaming) as words
    at that many per second; TTFA then counts from the first word. `text_frames`, if given, sets a
    request's length from its text instead (see serving_bench.py --text-tail-frames)."""

    def __init__(
        self, urls: list[str], text_rate: float = 0.0, text_frames: Callable[[str], int] | None = None
    ):
        self.backends = [Backend(url) for url in urls]
        self.text_rate, self.text_frames = text_rate, text_frames
        self._turn = itertools.count()

    def least_loaded(self) -> Backend:
        turn = next(self._turn) % len(self.backends)
        return min(self.backends[turn:] + self.backends[:turn], key=lambda b: b.in_flight)

    async def request(self, utterance: Utterance, speaker: str | None, sent: float) -> RequestResult:
        if self.text_frames is not None:
            utterance = replace(utterance, frames=self.text_frames(utterance.text))
        options = dict(speaker=speaker, seed=utterance.seed, max_frames=utterance.frames, ignore_eos=True)
        backend = self.least_loaded()
        arrivals = []  # on the harness's clock, from `sent`, as the openai target counts them

        def arrived(chunk) -> None:
            arrivals.append((time.perf_counter() - sent, chunk.seconds))

        if self.text_rate:
            pieces = words_at(utterance.text, self.text_rate)
            synthesis = await backend.synthesize_text_stream(pieces, info=True, on_chunk=arrived, **options)
        else:
            synthesis = await backend.synthesize(utterance.text, info=True, on_chunk=arrived, **options)
        error = synthesis.error or (
            None if synthesis.completed else "stream ended without its final response"
        )
        lanes = [LANES[int(c.info[3])] for c in synthesis.chunks]
        return played(
            sent, arrivals, error, lanes, utterance.seconds, synthesis.last_audio_after_last_piece_s
        )

    async def close(self) -> None:
        for backend in self.backends:
            await backend.close()


@dataclass
class Endpoint:
    """An OpenAI-compatible streaming speech endpoint: `POST {url}/v1/audio/speech` returning `pcm`
    as it is generated. The fixed length goes in `length_field` (frames at 12.5 Hz), the request's
    seed in `seed_field` (none when empty), and `extra_body` carries the server's own fields.
    As a system under measurement it is the user's: the harness neither starts nor stops it, and
    reads none of its metrics (it has no `servers`)."""

    url: str
    model: str
    extra_body: dict = field(default_factory=lambda: dict(GATEWAY_EXTRA_BODY))
    length_field: str = "max_frames"
    seed_field: str = "seed"
    label: str = "openai"
    gpus: int = 0  # the GPUs it computes on, as its user says (0: not known)
    servers = ()
    proxy_ports = None  # none of the harness's

    def start(self) -> None:
        pass

    def stop(self, logs) -> None:
        pass

    def proxy_sample(self) -> None:  # no proxy of the harness's in front of it
        return None

    def make_target(self) -> OpenAITarget:
        return OpenAITarget(self)

    def body(self, utterance: Utterance, voice: str | None) -> dict:
        body = {"model": self.model, "input": utterance.text, "response_format": "pcm", **self.extra_body}
        if voice:
            body["voice"] = voice
        body[self.length_field] = utterance.frames
        if self.seed_field:
            body[self.seed_field] = utterance.seed
        return body


def parse_extra_body(text: str) -> dict:
    """--extra-body's JSON object; ValueError saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--extra-body: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--extra-body: must be a JSON object, got {type(value).__name__}")
    return value


class OpenAITarget:
    """An Endpoint over HTTP (httpx, which the openai client brings). Audio is counted as it arrives:
    bytes -> seconds at 24 kHz, 16-bit mono; a response that is not 200 is a failed request. Late
    pieces are numbered by network read (the server's chunks are not visible in the bytes), and
    their lane is "unknown"."""

    def __init__(self, endpoint: Endpoint):
        try:
            import httpx
        except ImportError:
            raise SystemExit("--target openai needs httpx: python -m pip install httpx") from None
        self.endpoint = endpoint
        self.transfer_error = httpx.HTTPError
        # No pool limit: an open-loop probe holds one connection per stream in flight.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # Straight to the endpoint: no proxy from the environment between the client and the server.
        self.client = httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(None, connect=10.0), trust_env=False
        )

    async def request(self, utterance: Utterance, speaker: str | None, sent: float) -> RequestResult:
        url = self.endpoint.url.rstrip("/") + "/v1/audio/speech"
        arrivals: list[tuple[float, float]] = []
        received = 0  # bytes; a piece may end mid-sample, so seconds come from the running total
        async with self.client.stream("POST", url, json=self.endpoint.body(utterance, speaker)) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return played(sent, [], f"HTTP {response.status_code}: {detail}", asked_s=utterance.seconds)
            try:
                async for piece in response.aiter_bytes():
                    if not received and piece.startswith(b"RIFF"):  # a header is no audio to play
                        return played(
                            sent, [], "the body is a WAV file, not raw pcm", asked_s=utterance.seconds
                        )
                    samples = received // 2
                    received += len(piece)
                    if received // 2 > samples:  # audio arrives in whole samples (a read may split one)
                        arrivals.append(
                            (time.perf_counter() - sent, (received // 2 - samples) / PCM_SAMPLE_RATE)
                        )
            except self.transfer_error as error:  # a body that ends without its last chunk: cut short
                return played(sent, arrivals, f"stream cut short: {error!r}", asked_s=utterance.seconds)
        return played(sent, arrivals, None, asked_s=utterance.seconds)

    async def close(self) -> None:
        await self.client.aclose()
