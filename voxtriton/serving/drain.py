"""A shutdown that cuts no stream: the `tts` model's side of `drain_file`.

Triton counts a decoupled request as done once `execute` returns, so on SIGTERM it unloads every
model at once, the codec models too, and streams still generating fail. Instead, whoever stops the
server first creates the drain file (`voxtriton serve` does on its first SIGTERM or Ctrl-C): from
then on the model answers every new request "server shutting down" (a first piece of an input
stream too; later pieces of open ones are still taken), and once no execute call, input stream,
voice encoding or stream is left it writes `<drain_file>.done`. Stopping Triton after that cuts
nothing. Both files are removed when the model loads: they belong to one run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

SHUTTING_DOWN = "server shutting down: not taking new requests; retry on another server"


def done_marker(drain_file: Path) -> Path:
    """The file the model writes once a drain has left no stream: `<drain_file>.done`."""
    return drain_file.with_name(drain_file.name + ".done")


class Drain:
    def __init__(self, path: str, idle: Callable[[], bool], interval_s: float = 0.1):
        """path: the drain file ("" = never drain). idle: whether nothing is left in flight (checked
        with no execute call in progress)."""
        self.path = Path(path) if path else None
        self.done_path = done_marker(self.path) if self.path else None
        self.idle, self.interval_s = idle, interval_s
        self.lock = threading.Lock()
        self.started = False
        self.executing = 0  # execute calls in progress: each may yet submit what it took
        self._stopping = threading.Event()
        if self.path is not None:
            for leftover in (self.path, self.done_path):
                if leftover.exists():
                    log.warning("tts: removing %s, left by an earlier run", leftover)
                    leftover.unlink(missing_ok=True)
            self.thread = threading.Thread(target=self._watch, name="voxtriton-drain", daemon=True)
            self.thread.start()

    @contextlib.contextmanager
    def execute(self) -> Iterator[bool]:
        """Around an execute call: whether it must refuse new requests (the drain has started)."""
        with self.lock:
            draining = self._draining()
            self.executing += 1
        try:
            yield draining
        finally:
            with self.lock:
                self.executing -= 1

    def _draining(self) -> bool:
        if not self.started and self.path is not None and self.path.exists():
            self.started = True
            log.info("tts: draining: no new requests; %s once the streams in flight end", self.done_path)
        return self.started

    def _watch(self) -> None:
        while not self._stopping.wait(self.interval_s):
            try:
                with self.lock:
                    drained = self._draining() and not self.executing and self.idle()
                if drained:
                    self.done_path.touch()
                    log.info("tts: drained: no stream left")
                    return
            except Exception:  # keep watching: the launcher waits for the file
                log.exception("tts: drain check failed")

    def shutdown(self) -> None:
        self._stopping.set()
