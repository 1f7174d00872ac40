"""The engine thread: admits requests, runs one frame step for every running request, and hands the
frames to the chunk scheduler, which cuts chunks and queues them on a lane."""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import numpy as np
import torch

from ...engine.request import Request

log = logging.getLogger(__name__)


class EngineLoop:
    """Part of `TTSService`: the engine thread's loop."""

    def _engine_loop(self) -> None:
        with self.engine_context:
            self._run_engine()

    def _run_engine(self) -> None:
        while self.running:
            try:
                self._engine_iteration()
            except Exception as error:  # a bug or device fault: fail the running streams, keep serving
                log.error("engine iteration failed: %s", traceback.format_exc())
                try:
                    self._fail_all_running(f"generation failed: {error}")
                except Exception:  # the thread outlives its error path too: the next failure retries it
                    log.exception("failing the running streams failed")

    def _engine_iteration(self) -> None:
        # The pass's wall time includes waiting for the lock; its CPU time on this thread, next to the
        # wall time outside the decode, tells waiting (for the GIL, the lock, a CPU) from work.
        started, cpu_started = time.perf_counter(), time.thread_time()
        with self.lock:
            self._hand_text()
            while self.running and not self.incoming and not self.engine.has_work:
                self.engine_idle = True
                # Woken by submit, by text, or when a stream waiting for text must send its frames;
                # the timeout also refreshes the gauges.
                self.lock.wait(self._idle_wait())
                if self.scheduler.send_for_text_waits():
                    self.lock.notify_all()
                    if self.scheduler.config.rules.inline_decode:
                        break  # this thread decodes the chunk, after the (empty) step below
                self._publish_gauges()
                started, cpu_started = (
                    time.perf_counter(),
                    time.thread_time(),
                )  # idle time is not part of a frame step
                self._hand_text()
            self.engine_idle = False
            held_s = self._hold_for_first_chunk()  # returns at once when the service has stopped
            if not self.running:
                return
            if held_s:  # the hold is not part of the frame step
                started, cpu_started = time.perf_counter(), time.thread_time()
            for stream in self.incoming:
                if stream.closed:  # ended before it reached the engine (a sequence's error, a timeout)
                    continue
                try:
                    self.engine.add(stream.request)
                except ValueError as error:
                    self._end(stream, str(error))
                    continue
                self.scheduler.add(stream)
            self.incoming.clear()
            self._hand_text()
            light = self.scheduler.light_load()  # streams start with one frame: their first come early
            # A first frame's chunk is decoded while the engine holds: the backbone's part of its step
            # waits too, so the codec call shares the GPU with nothing.
            defer = self.scheduler.holds_for_first_chunks()
        outputs = self.engine.step(first_frames_early=light, defer_advance=defer)
        with self.lock:
            silent = [output.request for output in outputs if output.codes is None]
            for output in outputs:
                if output.codes is not None:
                    self._on_frame(output.request, output.codes, output.finish_reason)
            self._note_text_waits()
            self._publish_gauges()
            self.lock.notify_all()
        for request in silent:
            self._end_without_audio(request)
        if self.scheduler.config.rules.inline_decode:
            self._drain_inline()  # part of the pass (its time counts as "other"): the codec takes its turn
        period, timing = time.perf_counter() - started, self.engine.last_timing
        host_cpu = time.thread_time() - cpu_started - timing.decode_cpu_s
        frames = len(outputs) - len(silent)
        if self.metrics and frames:
            self.metrics.frame_step(period, frames, timing, host_cpu)
        if self.metrics and held_s:
            self.metrics.first_chunk_hold(held_s)
        if self.chunk_trace and (outputs or timing.batch):  # with overlap, a first launch returns nothing
            with self.lock:
                self._write_trace(
                    {
                        "kind": "step",
                        "end": self.clock(),
                        "period": period,
                        "frames": frames,
                        "host_cpu_s": host_cpu,
                        "held_s": held_s,
                        **dataclasses.asdict(timing),
                    }
                )

    def _hold_for_first_chunk(self) -> float:
        """Under the lock, before a frame step: wait while the scheduler holds the backbone for first
        chunks' codec calls (`first_chunk_hold_s`); the lane worker whose call returns wakes this
        thread, and so does a request that arrives (it ends the hold: the step admits it). Returns the
        seconds held."""
        started, held = time.perf_counter(), 0.0
        while self.running and not self.incoming and (left := self.scheduler.first_chunk_hold_left()) > 0:
            self.lock.wait(left)
            held = time.perf_counter() - started
        return held

    def _idle_wait(self) -> float:
        """Seconds the idle engine thread may sleep: until a stream waiting for text must send its
        frames, at most 0.5."""
        send_at = self.scheduler.next_text_wait_send()
        return 0.5 if send_at is None else min(0.5, max(0.001, send_at - self.clock()))

    def _hand_text(self) -> None:
        """Give the engine the text that reached input streams (under the lock, between steps)."""
        if not self.text_arrived:
            return
        for stream in self.text_arrived.values():
            if stream.closed:
                continue
            ids, stream.new_text = stream.new_text, []
            stream.text_handed_at = stream.text_at
            stream.text_open = not stream.text_ended
            try:
                self.engine.add_text(stream.request, ids, stream.text_ended)
            except ValueError as error:
                self._end(stream, str(error))
        self.text_arrived.clear()
        self._note_text_waits()  # a stream with new text may generate again

    def _note_text_waits(self) -> None:
        """Tell the scheduler which streams wait for text now (it may cut their chunks)."""
        self.scheduler.set_text_waits({r.request_id for r in self.engine.waiting_for_text()})

    def _on_frame(self, request: Request, codes: np.ndarray, reason: str | None) -> None:
        stream = self.streams.get(request.request_id)
        # A stream under this id may be a newer request's, submitted after the first one ended.
        if stream is None or stream.closed or stream.request is not request:
            return
        stream.frames.append(codes)
        if reason is not None and not stream.generation_done:  # (the engine sends one last frame)
            stream.generation_done = True
            self.draining += 1
        cut = self.scheduler.frames_generated(request.request_id, 1, done=stream.generation_done)
        if stream.input_stream and any(chunk.index == 0 for chunk in cut):
            stream.first_chunk_text_at = stream.text_handed_at

    def _end_without_audio(self, request: Request) -> None:
        """A request whose first frame was its end (the reference model gives it no audio): its
        stream's final response holds none (sent without the service lock, like every chunk)."""
        stream = self.streams.get(request.request_id)
        if stream is None or stream.closed or stream.request is not request:
            return
        failure = None
        try:
            empty = np.zeros((0, self.engine.runner.codebooks), np.int64)
            stream.sink.send(torch.zeros(0), empty, np.zeros(4, np.int64), True)
        except Exception as error:
            failure = f"sending its final response failed: {error}"
        with self.lock:
            self._end(stream, failure)

    def _fail_all_running(self, message: str) -> None:
        """After a failed step: end every stream the engine had taken, running, being admitted
        (those were in neither of its lists) or with frames in flight, with the error. Streams still
        in `incoming` wait for the next step; streams whose last frame had reached the service still
        get their remaining chunks. (A request the engine marked finished whose last frame was lost
        with the step is failed too: nothing else would end its stream.)"""
        with self.lock:
            for stream in list(self.streams.values()):
                if stream not in self.incoming and not stream.generation_done:
                    stream.request.cancelled = True
                    self._end(stream, message)
            self.engine.abort()
