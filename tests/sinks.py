"""A response sink for service tests: what a stream was sent, in process."""

from __future__ import annotations

import threading

import numpy as np


class CollectingSink:
    def __init__(self):
        self.audio, self.codes, self.info, self.errors, self.done = [], [], [], [], threading.Event()
        self.cancel = False

    def send(self, audio, codes, info, final):
        if self.done.is_set():  # as sinks do after their final response or error (ResponseSink.send)
            return
        self.audio.append(audio.numpy().copy())
        self.codes.append(np.asarray(codes).copy())
        self.info.append(info.copy())
        if final:
            self.done.set()

    def fail(self, message):
        self.errors.append(message)
        self.done.set()

    def cancelled(self):
        return self.cancel
