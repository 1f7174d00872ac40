"""The codec lanes' workers: each takes a batch from its lane's queue, calls the codec (BLS in the
server), sends each chunk's audio to its stream without the service lock, and lets the scheduler cut
that stream's next chunk."""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from ...scheduler.policy import BACKGROUND, INLINE, URGENT, Chunk
from .streams import RUNNING

log = logging.getLogger(__name__)

LANE_CODES = {URGENT: 0, BACKGROUND: 1, INLINE: 2}


def own_stream(device: torch.device):
    """A CUDA stream for the calling thread's work (a no-op context on CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def padded_codes(frames: list[np.ndarray], length: int) -> np.ndarray:
    """A chunk's frames [T, Q], the last one repeated up to `length` (see `Chunk.decode_frames`)."""
    codes = np.stack(frames)
    return np.concatenate([codes, np.repeat(codes[-1:], length - len(codes), axis=0)])


class LaneWorkers:
    """Part of `TTSService`: the lane workers' loop and the codec call of a batch."""

    def _lane_loop(self, lane: str) -> None:
        with own_stream(self.device):
            self._serve_lane(lane)

    def _serve_lane(self, lane: str) -> None:
        while self.running:
            try:
                with self.lock:
                    priming, batch = self._next_work(lane)
                    while self.running and not (priming or batch):
                        self.lock.wait(0.5)
                        priming, batch = self._next_work(lane)
            except Exception:  # a bug choosing the work: the worker goes on (its lane would stop)
                log.exception("codec lane %s: choosing its next work failed", lane)
                time.sleep(0.1)
                continue
            if priming is not None:
                self._prime_ahead(priming)
            elif batch:
                self._run_batch(lane, batch)

    def _run_batch(self, lane: str, batch: list[Chunk]) -> None:
        try:
            self._decode_batch(lane, batch)
        except Exception as error:  # a bug: the batch's streams end with it, the lane goes on
            log.exception("codec lane %s: a batch failed", lane)
            self._fail_streams(lane, [chunk.stream for chunk in batch], error)

    def _next_work(self, lane: str):
        """(None, a batch), or when the lane has no chunk to decode, (a stream to prime, None):
        primings fill the urgent lane's idle time; one still queued when its first chunk is decoded
        is primed by that chunk's call (`_await_primings`)."""
        batch = self.scheduler.next_batch(lane)
        if batch or lane != URGENT or not self.primings:
            return None, batch
        stream = self.primings.popleft()
        stream.priming = RUNNING
        return stream, []

    def _primes_ahead(self, lane: str | None) -> bool:
        """Whether an in-context stream pinned to `lane` (None: routed) is primed on the urgent lane
        as soon as it is submitted, where every first chunk is decoded (the lane workers' policies),
        while its prompt prefills and its first frames are generated."""
        return not self.scheduler.config.rules.inline_decode and lane in (None, URGENT)

    def _prime_ahead(self, stream) -> None:
        primed = False
        if not stream.closed:
            try:
                issued = self.clock()
                if not self._prime(URGENT, stream):  # a codec call: the lane was busy with it
                    started, ended = self._call_span(URGENT, issued)
                    if self.metrics:
                        self.metrics.codec_call(
                            URGENT, len(stream.request.prompt.reference_codes), ended - started
                        )
                primed = True
            except Exception as error:  # its first chunk primes it on its own lane
                log.warning("stream %s: priming ahead failed: %s", stream.request.request_id, error)
        with self.lock:
            stream.priming = None
            if primed:
                stream.primed_on, stream.primed_at = URGENT, self.clock()
            self._free_slot(stream)  # if it ended meanwhile
            self.lock.notify_all()

    def _await_primings(self, batch: list[Chunk]) -> None:
        """Under the lock, before a batch's codec call: a first chunk's stream whose priming has not
        started is primed by this call's worker instead; one being primed is waited for."""
        for chunk in batch:
            if chunk.first_frame == 0:
                self._unqueue_priming(chunk.stream)
        while any(chunk.stream.priming == RUNNING for chunk in batch):
            self.lock.wait()

    def _drain_inline(self) -> None:
        while True:
            with self.lock:
                batch = self.scheduler.next_batch(INLINE)
            if not batch:
                return
            self._run_batch(INLINE, batch)

    def _call_span(self, lane: str, issued: float) -> tuple[float, float]:
        """(start, end) of a codec call just returned. With several workers on a lane, a call issued
        while the lane's previous one ran waited for it in Triton's queue (one codec instance runs
        one call at a time): it starts when that one ended. Counting the wait would inflate the lane's
        decode estimate, and with it the slack the scheduler routes by. A worker that records its
        end late (descheduled after its call returned) can leave the wait counted: an approximation."""
        ended = self.clock()
        with self.lane_clock_lock:
            started = max(issued, self.lane_free_at.get(lane, issued))
            self.lane_free_at[lane] = max(ended, self.lane_free_at.get(lane, ended))
        return started, ended

    def _prime(self, lane: str, stream) -> bool:
        """Put into the stream's codec state row what decoding its in-context voice's reference codes
        from a fresh state leaves there, as the official implementation decodes them in front of the
        generated ones (their audio is dropped). A registered voice's primed state is kept (in
        `primed_states`) and copied into the row at its next streams: no codec call. Returns
        whether the state was such a copy."""
        prompt, slot = stream.request.prompt, stream.codec_slot
        kept = self.primed_states if prompt.reference_key is not None else None
        key = (lane, prompt.reference_key)
        reused = kept is not None and kept.restore(key, slot)
        if not reused:
            self.lanes[lane].decode(
                torch.from_numpy(prompt.reference_codes[None].astype(np.int32)),
                torch.zeros(1, dtype=torch.int64),  # start 0: from a fresh state
                torch.tensor([slot], dtype=torch.int64),
                prime=True,
            )
            if kept is not None:
                kept.keep(key, slot)
        if self.metrics:
            self.metrics.codec_primed(lane, reused)
        return reused

    @staticmethod
    def _primed_frames(stream) -> int:
        """Frames the stream's codec state holds before its first generated frame (its in-context
        voice's reference codes)."""
        prime = stream.request.prompt.reference_codes
        return 0 if prime is None else len(prime)

    def _prime_first_chunks(self, lane: str, codec_lane: str, live: list, codes: np.ndarray):
        """Prime the first chunks' streams not primed on `codec_lane` yet; one whose priming fails
        ends with the error, alone, and leaves the batch. Returns the batch's (live, codes) left."""
        failed = []
        for row, (chunk, stream) in enumerate(live):
            if chunk.first_frame == 0 and self._primed_frames(stream) and stream.primed_on != codec_lane:
                try:
                    self._prime(codec_lane, stream)
                except Exception as error:
                    log.error(
                        "stream %s: priming on lane %s failed: %s", stream.request.request_id, lane, error
                    )
                    self._fail_streams(lane, [stream], error)
                    failed.append(row)
        if not failed:
            return live, codes
        kept = [row for row in range(len(live)) if row not in failed]
        return [live[row] for row in kept], codes[kept]

    def _fail_streams(self, lane: str, streams: list, error: Exception) -> None:
        """End streams whose chunk a codec call failed, and give their rows back (also those of
        streams that had ended meanwhile, cancelled)."""
        with self.lock:
            for stream in streams:
                stream.decoding = False
                self._end(stream, f"codec lane '{lane}' failed: {error}")
                self._free_slot(stream)
            self.lock.notify_all()

    def _decode_batch(self, lane: str, batch: list[Chunk]) -> None:
        with self.lock:
            self._await_primings(batch)
            live = [(c, c.stream) for c in batch if not c.stream.closed]  # streams still open
            if not live:
                return
            codes = np.stack(
                [
                    padded_codes(s.frames[c.first_frame : c.first_frame + c.frames], c.decode_frames)
                    for c, s in live
                ]
            )
            for _, stream in live:
                stream.decoding = True
        issued = self.clock()
        codec_lane = URGENT if lane == INLINE else lane
        live, codes = self._prime_first_chunks(lane, codec_lane, live, codes)
        if not live:
            return
        try:
            audio = self.lanes[codec_lane].decode(
                torch.from_numpy(codes.astype(np.int32)),
                torch.tensor([c.first_frame + self._primed_frames(s) for c, s in live], dtype=torch.int64),
                torch.tensor([s.codec_slot for _, s in live], dtype=torch.int64),
            )
            samples_per_frame = audio.shape[1] // codes.shape[1]
        except Exception as error:
            log.error("codec lane %s failed: %s", lane, error)
            self._fail_streams(lane, [stream for _, stream in live], error)
            return
        started, ended = self._call_span(lane, issued)
        elapsed = ended - started
        if self.metrics:
            self.metrics.codec_call(lane, codes.shape[0] * codes.shape[1], elapsed)
        with self.lock:
            deliveries = []
            for row, (chunk, stream) in enumerate(live):
                stream.decoding = False
                chunk.decoded = True
                if stream.closed:
                    self._free_slot(stream)
                else:
                    deliveries.append((row, chunk, stream))
            if any(chunk.index == 0 for chunk, _ in live):  # the engine may hold for it: it need not now
                self.lock.notify_all()
        # Sends (IPC round trips) go out without the service lock. A stream has one chunk in flight, so
        # nothing else sends for it; one ended meanwhile has a closed sink, which drops the chunk.
        sent = []  # (chunk, stream, when it was sent, why it was not)
        for row, chunk, stream in deliveries:
            info = np.array([chunk.index, chunk.first_frame, chunk.frames, LANE_CODES[chunk.lane]], np.int64)
            try:
                stream.sink.send(
                    audio[row, : chunk.frames * samples_per_frame],
                    codes[row, : chunk.frames],
                    info,
                    chunk.last,
                )
                sent.append((chunk, stream, self.clock(), None))
            except Exception as error:  # the client gone, or a send the server could not make
                log.info("stream %s: send failed (%s); ending it", stream.request.request_id, error)
                sent.append((chunk, stream, None, f"sending its audio failed: {error}"))
        with self.lock:
            for chunk, stream, sent_at, failure in sent:
                if failure is not None or stream.closed:
                    # The error reaches a client still there; a no-op for a stream ended meanwhile.
                    self._end(stream, failure)
                    continue
                try:
                    self._chunk_delivered(chunk, stream, elapsed, len(live), started, ended, sent_at)
                except Exception as error:
                    # A bug: this chunk's stream ends with it, the batch's others go on.
                    log.exception("codec lane %s: a chunk's bookkeeping failed", lane)
                    self._end(stream, f"codec lane '{lane}' failed: {error}")
            self.lock.notify_all()

    def _chunk_delivered(
        self, chunk: Chunk, stream, elapsed: float, batch: int, started, ended, sent_at
    ) -> None:
        """Under the lock, after a chunk's audio was sent: its metrics and trace, and the scheduler
        cuts the stream's next chunk (another worker may take it once the lock is released, so a
        failure past this point must end this stream alone, never the whole batch)."""
        if self.metrics:
            self.metrics.chunk_sent(
                chunk.lane,
                chunk.frames,
                elapsed,
                chunk.index == 0,
                sent_at - stream.opened_at,
                chunk.promoted,
                (sent_at - stream.text_ended_at) if chunk.last and stream.text_ended_at is not None else None,
                since_text_s=(sent_at - stream.first_chunk_text_at)
                if chunk.index == 0 and stream.first_chunk_text_at is not None
                else None,
                text_wait=chunk.text_wait,
            )
        if self.chunk_trace:
            self._trace(chunk, batch, started, ended, sent_at)
        self.scheduler.chunk_done(chunk, elapsed, sent_at)
        if chunk.last:
            self._end(stream, None)
