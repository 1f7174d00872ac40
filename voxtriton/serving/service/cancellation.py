"""The cancellation watcher: polls the clients' cancellation flags, off the engine thread (each check
is a round trip to the server process)."""

from __future__ import annotations

import logging
import time
import traceback

log = logging.getLogger(__name__)

# The longest the watcher keeps the service lock at once (the engine thread and the lanes wait it
# out); the check in progress finishes, so a hold is at least one check.
MAX_HOLD_S = 0.001


class CancellationWatcher:
    """Part of `TTSService`: ends the streams whose client cancelled or went away."""

    def _watch_cancellations(self) -> None:
        """End the streams whose client cancelled or went away; their generation stops at the next step.

        A check is a round trip to the server process that drops the GIL, and taking the GIL back
        beside a thread running Python waits about the switch interval (5 ms; benchmarks/bls_gil.py).
        So checks run under the service lock, where the threads that would compete for the GIL wait
        on the lock instead: a burst of plain round trips, not a GIL handoff per stream. The lock is
        let go once a hold has lasted MAX_HOLD_S, and then left alone long enough that the watcher
        holds it at most `cancellation_lock_share` of the time: a sweep makes one check per open
        stream. A hold's time includes getting the GIL back after each check. Streams still
        generating or waiting for a row come first, as their cancellation frees a KV-cache row and a
        share of every frame step; draining ones (generated, audio still owed) after them.
        """
        pause_per_held_second = 1 / self.cancellation_lock_share - 1
        while not self._stopping.wait(self.cancellation_check_s):
            with self.lock:
                streams = sorted(self.streams.values(), key=lambda stream: stream.generation_done)  # (stable)
            position = 0
            while position < len(streams):
                with self.lock:
                    held_from = time.perf_counter()
                    checked, ended = 0, False
                    while position < len(streams) and (
                        not checked or time.perf_counter() - held_from < MAX_HOLD_S
                    ):
                        stream = streams[position]
                        position += 1
                        if not stream.closed:  # (ended since the sweep began)
                            checked += 1
                            ended |= self._end_if_cancelled(stream)
                    if ended:
                        self.incoming = [s for s in self.incoming if not s.closed]
                        self.lock.notify_all()
                    held = time.perf_counter() - held_from
                if self.metrics and checked:
                    self.metrics.cancellation_checks(checked, held)
                if self._stopping.wait(held * pause_per_held_second):
                    return

    def _end_if_cancelled(self, stream) -> bool:
        """End the stream if its client is gone (under the service lock); whether it was."""
        try:
            gone = stream.sink.cancelled()
        except Exception:  # the request is unreachable: treat the client as gone
            log.warning(
                "stream %s: cancellation check failed: %s",
                stream.request.request_id,
                traceback.format_exc(limit=1),
            )
            gone = True
        if gone:
            try:
                self._end(stream, "request cancelled")
            except Exception:  # keep watching the other streams
                log.error(
                    "stream %s: ending it failed: %s", stream.request.request_id, traceback.format_exc()
                )
        return gone
