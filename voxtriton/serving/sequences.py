"""Input streaming: the text pieces of one Triton sequence feed one stream.

A client sends a sequence's pieces as requests on one gRPC stream, with the sequence's id, the start
flag on the first and the end flag on the last. The first piece names the voice and the sampling
parameters (a later piece carrying any input but `text` is refused), and its response sender carries
the audio; every later piece is answered at once with an empty final response (or an error), its
text passed on. The stream is submitted once the tokenizer has settled its first text id (the prompt
holds it); the engine then waits for `text_lookahead` ids (`Engine`). A sequence that sends no text
for `text_idle_timeout_s` ends with an error (empty pieces do not count), and so does one still open
`text_stream_max_s` after its first piece (text trickling in, a word at a time or a character of a
word that never ends, must not hold a row for hours); all its pieces together are held to
max_text_bytes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engine.request import GenerationParams, Request
from ..errors import RequestError
from ..models.text import PromptHead, TextStream
from .requests import RequestParser
from .service.protocols import ResponseSink

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 4096  # ended sequence ids kept, to tell a piece after the end from an unknown id


@dataclass(eq=False)
class Sequence:
    sequence_id: str
    request_id: str
    head: PromptHead
    params: GenerationParams
    sink: ResponseSink  # the first piece's: carries the audio
    text: TextStream
    started_at: float  # its first piece (the stream's arrival, for TTFA and the first chunk's due time)
    last_piece_at: float
    known: list[int] = field(default_factory=list)  # text ids settled before the stream was submitted
    start_frames: int | None = None  # the first chunk's frames at least (None: the server's setting)
    has_words: bool = False  # a piece held more than white space (the stream starts after one)
    text_bytes: int = 0  # of all its pieces, held to max_text_bytes like a whole request's text
    submitted: bool = False


class TextSequences:
    """The open sequences of the `tts` model, by sequence id; safe to call from several threads."""

    def __init__(
        self,
        parser: RequestParser,
        service,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
        max_open_s: float = 600.0,
    ):
        """service: the TTSService (`submit`, `add_text`, `end_stream`; `clock` must be its clock). A
        thread ends idle sequences and those open longer than `max_open_s`,
        checking every `interval_s` (a quarter of the timeout, at most a second, by default)."""
        self.parser, self.service, self.idle_timeout_s, self.clock = parser, service, idle_timeout_s, clock
        self.max_open_s = max_open_s
        self.lock = threading.Lock()
        self.open: dict[str, Sequence] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> how it ended
        self._stopping = threading.Event()
        self.interval_s = interval_s or min(idle_timeout_s / 4, 1.0)
        self.thread = threading.Thread(target=self._expire_loop, name="voxtriton-sequences", daemon=True)
        self.thread.start()

    def piece(
        self,
        sequence_id: str,
        start: bool,
        end: bool,
        inputs: dict[str, np.ndarray],
        request_id: str,
        sink: Callable[[], ResponseSink],
    ) -> None:
        """Take one piece. `sink()` makes the response sink of this piece's request (called for a
        sequence's first piece only). Raises RequestError for a bad piece: the caller answers this
        piece's request with it; the sequence's stream, if it is gone too, got its own error."""
        with self.lock:
            sequence = self.open.get(sequence_id)
            if sequence is not None and self._stream_ended(sequence):  # cancelled, or failed
                self._close(sequence, "its stream ended")
                sequence = None
            if start:
                if sequence is not None:
                    raise RequestError(
                        "sequence_start", f"sequence {sequence_id} is already open (it has not ended)"
                    )
                try:
                    head, params, text, start_frames = self.parser.parse_stream(inputs)
                except RequestError as error:  # its later pieces are told why, not that none started
                    self._remember_end(sequence_id, f"its first piece was refused: {error}")
                    raise
                sequence = Sequence(
                    sequence_id,
                    request_id,
                    head,
                    params,
                    sink(),
                    TextStream(self.parser.prompts.tokenizer),
                    self.clock(),
                    self.clock(),
                    start_frames=start_frames,
                )
                self.open[sequence_id] = sequence
                self.ended.pop(sequence_id, None)
            elif sequence is None:
                how = self.ended.get(sequence_id)
                raise RequestError(
                    "sequence_id",
                    f"sequence {sequence_id} has ended ({how}): a piece after its end"
                    if how
                    else f"unknown sequence {sequence_id}: its first piece must carry sequence_start",
                )
            limit = self.parser.settings.max_text_bytes
            try:  # a bad piece ends its sequence: text left out, or an end lost, would pass unseen
                if not start:
                    taken_from_the_first = sorted(set(inputs) - {"text"})
                    if taken_from_the_first:  # not dropped unseen: one could be a bad value
                        raise RequestError(
                            taken_from_the_first[0],
                            f"sequence {sequence_id}: only a sequence's first piece takes options; "
                            "later pieces carry text alone",
                        )
                    text = self.parser.piece_text(inputs)
                    if text:  # empty pieces do not keep an idle sequence open
                        sequence.last_piece_at = self.clock()
                sequence.has_words |= bool(text.strip())
                sequence.text_bytes += len(text.encode("utf-8"))
                if sequence.text_bytes > limit:
                    raise RequestError("text", f"sequence {sequence_id}: too long: over {limit} bytes in all")
                ids = sequence.text.feed(text) + (sequence.text.finish() if end else [])
                if end:
                    self._close(sequence, "its last piece arrived")
                self._feed(sequence, ids, end)
            except Exception as error:
                self._close(sequence, f"failed: {error}")
                if sequence.submitted or not start:  # else the caller answers the first piece's sender
                    self._fail(sequence, str(error))
                raise

    def _feed(self, sequence: Sequence, ids: list[int], end: bool) -> None:
        if not sequence.submitted:
            sequence.known += ids
            if not (sequence.known and sequence.has_words):
                if end:
                    raise RequestError("text", f"sequence {sequence.sequence_id}: the text is empty")
                return
            # Its end, if it came already, goes the way of every end (`add_text`), which times it.
            prompt = sequence.head.prompt(sequence.known, interleaved=True, text_ended=False)
            request = Request(
                sequence.request_id,
                prompt,
                sequence.params,
                text_open=True,
                start_frames=sequence.start_frames,
            )
            self.service.submit(request, sequence.sink, opened_at=sequence.started_at)
            sequence.submitted, ids = True, []
            if not end:
                return
        if not self.service.add_text(sequence.request_id, ids, end):
            self._close(sequence, "its stream ended")
            raise RequestError(
                "sequence_id", f"sequence {sequence.sequence_id}: its stream has ended; text dropped"
            )

    def _close(self, sequence: Sequence, how: str) -> None:
        if self.open.get(sequence.sequence_id) is sequence:
            del self.open[sequence.sequence_id]
            self._remember_end(sequence.sequence_id, how)

    def _remember_end(self, sequence_id: str, how: str) -> None:
        self.ended[sequence_id] = how
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)

    def idle(self) -> bool:
        with self.lock:
            return not self.open

    def _stream_ended(self, sequence: Sequence) -> bool:
        """Its stream ended without it (a failure, a client's cancel): the service ended a submitted
        one; the client of one not submitted yet (no word settled) may have cancelled its call."""
        if sequence.submitted:
            return not self.service.is_open(sequence.request_id)
        return sequence.sink.cancelled()

    def expire(self) -> None:
        """End the sequences that have had no piece for `idle_timeout_s` or have been open for
        `max_open_s`, and forget those whose stream ended without them (a client's cancel, a
        failure, also before a word settled): their ids may start again."""
        now = self.clock()
        expired = []
        with self.lock:
            for sequence in [s for s in self.open.values() if self._stream_ended(s)]:
                self._close(sequence, "its stream ended")
            for sequence in list(self.open.values()):
                if now - sequence.last_piece_at > self.idle_timeout_s:
                    reason = f"had no text piece for {self.idle_timeout_s:g} s (text_idle_timeout_s)"
                elif now - sequence.started_at > self.max_open_s:
                    reason = f"was open for more than {self.max_open_s:g} s (text_stream_max_s)"
                else:
                    continue
                self._close(sequence, "timed out")
                expired.append((sequence, reason))
        for sequence, reason in expired:  # the client's doing: an error of its text, not the server's
            problem = f"sequence {sequence.sequence_id} {reason}; mark its last piece as its end"
            self._fail(sequence, str(RequestError("text", problem)))

    def _fail(self, sequence: Sequence, message: str) -> None:
        """End a sequence's audio with an error: through its stream once submitted, else at its sink."""
        if sequence.submitted:
            self.service.end_stream(sequence.request_id, message)
            return
        try:
            sequence.sink.fail(message)
        except Exception:  # the client may be gone; the other sequences go on
            log.exception("sequence %s: its error could not be sent", sequence.sequence_id)

    def _expire_loop(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                self.expire()
            except Exception:  # a bug: the next sweep may still end what this one could not
                log.exception("expiring text sequences failed")

    def shutdown(self) -> None:
        """Stop, and end every open sequence with an error."""
        self._stopping.set()
        self.thread.join(5)
        with self.lock:
            open_sequences = list(self.open.values())
            for sequence in open_sequences:
                self._close(sequence, "the server shut down")
        for sequence in open_sequences:
            self._fail(sequence, "server shutting down")
