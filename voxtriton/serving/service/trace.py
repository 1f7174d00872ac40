"""The chunk trace: one JSON line per chunk sent and per frame step, for diagnosis."""

from __future__ import annotations

import json
import logging

from ...scheduler.policy import Chunk

log = logging.getLogger(__name__)


class ChunkTrace:
    """Part of `TTSService`: writes `chunk_trace` (None: off)."""

    def _trace(self, chunk: Chunk, batch: int, started: float, decoded: float, sent: float) -> None:
        """One chunk's path, on the service clock (seconds): its request arrived, the service took
        it (once its reference voice, if it brought one, was encoded, or an input stream's first
        words were there), its frames were
        cut into a chunk (when they were generated, or when the stream's previous chunk was done,
        whichever was later), its codec call started and ended, and when it was due (playback
        deadline, or for a first chunk the TTFA target)."""
        self._write_trace(
            {
                "kind": "chunk",
                "stream": chunk.stream.stream_id,
                "index": chunk.index,
                "lane": chunk.lane,
                "promoted": chunk.promoted,
                "taken": chunk.taken,
                "text_wait": chunk.text_wait,
                "frames": chunk.frames,
                "batch": batch,
                "arrived": chunk.stream.opened_at,
                "submitted": chunk.stream.submitted_at,  # its voice encoded, an input stream's first words
                "primed": chunk.stream.primed_at,  # an in-context voice's priming ahead ended
                "text_ended": chunk.stream.text_ended_at,  # an input stream's last piece (else None)
                "cut": chunk.ready_at,
                "start": started,
                "end": decoded,
                "due": chunk.due(self.scheduler.config.ttfa_target_s),
                "sent": sent,
            }
        )

    def _write_trace(self, record: dict) -> None:
        """One line of the trace: a chunk sent, or a frame step (its period, its frames, and its
        `StepTiming`). Under the service lock. A failed write (disk full, file closed) turns the
        trace off: it must never stop a lane or the engine."""
        try:
            self.chunk_trace.write(json.dumps(record) + "\n")
        except (OSError, ValueError) as error:
            log.error("chunk trace stopped: %s", error)
            self.chunk_trace = None
