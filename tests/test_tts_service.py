"""The tts service's bookkeeping with in-process codec lanes: every codec slot comes back."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from voxtriton.engine.engine import Engine
from voxtriton.engine.model_runner import ModelRunner
from voxtriton.models.config import load_config
from voxtriton.models.loader import load_backbone
from voxtriton.models.text import PromptBuilder, TextTokenizer
from voxtriton.scheduler.policy import BACKGROUND, URGENT, SchedulerConfig
from voxtriton.serving.requests import RequestParser
from voxtriton.serving.settings import TTSSettings
from voxtriton.serving.tts_service import TTSService, codec_slots


class LaneThatFailsAfterCancellation:
    """A codec lane whose first call waits until the test has cancelled the stream, then fails."""

    def __init__(self):
        self.called, self.release = threading.Event(), threading.Event()

    def decode(self, codes, start, slots):
        self.called.set()
        self.release.wait(60)
        raise RuntimeError("codec process died")


class CancellableSink:
    def __init__(self):
        self.cancel, self.errors, self.chunks = False, [], 0

    def send(self, audio, codes, info, final):
        self.chunks += 1

    def fail(self, message):
        self.errors.append(message)

    def cancelled(self):
        return self.cancel


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("policy", ["concurrent", "serial"])
def test_a_slot_comes_back_when_a_lane_fails_a_stream_that_was_cancelled_meanwhile(tiny_checkpoint, policy):
    config = load_config(tiny_checkpoint)
    settings = TTSSettings(checkpoint_dir=str(tiny_checkpoint), max_streams=2, max_positions=256)
    runner = ModelRunner(load_backbone(tiny_checkpoint, config), 2, 256, settings.max_text_tokens)
    parser = RequestParser(config, PromptBuilder(config, TextTokenizer(tiny_checkpoint)), settings)
    lane = LaneThatFailsAfterCancellation()
    scheduler_config = SchedulerConfig(policy=policy)
    engine = Engine(runner, 2)
    service = TTSService(engine, scheduler_config, {URGENT: lane, BACKGROUND: lane}, max_queued=1,
                         cancellation_check_s=0.01)
    try:
        slots = codec_slots(engine, 1, scheduler_config)
        sink = CancellableSink()
        inputs = {"text": np.array([b"Cancelled while decoding."], dtype=object), "max_frames": np.array([40]),
                  "ignore_eos": np.array([True])}
        service.submit(parser.parse("r1", inputs), sink)
        assert lane.called.wait(60)
        if policy == "serial":  # the engine thread itself is in the codec call: nobody polls cancellation
            lane.release.set()
        else:
            sink.cancel = True
            wait_for(lambda: "r1" not in service.streams)  # ended by the engine thread's cancellation poll
            assert len(service.free_slots) == slots - 1  # the lane may still write its row
            lane.release.set()
        wait_for(lambda: len(service.free_slots) == slots)
        expected = "request cancelled" if sink.cancel else "codec lane 'inline' failed: codec process died"
        assert sink.chunks == 0 and sink.errors == [expected]
    finally:
        lane.release.set()
        service.shutdown()
