"""Stopping a server without cutting a stream (a real tritonserver, tiny random-weight checkpoint):
once drained, the tts model refuses new requests and new input streams, lets the stream in flight
and an open input stream end with all their audio, and then reports that none is left."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from server_helpers import start_server
from test_input_streaming_server import RawStream
from voxtriton_client import TTSClient

from voxtriton.serving.drain import Drain
from voxtriton.serving.settings import TTSSettings

FRAMES = 120


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_drain_ends_when_nothing_is_in_flight_nor_being_taken(tmp_path):
    """An earlier run's files go at load; after the drain file appears, `.done` waits for the idle
    check and for every execute call in progress (it may yet submit what it took)."""
    drain_file, done = tmp_path / "drain", tmp_path / "drain.done"
    drain_file.touch()
    done.touch()
    busy = threading.Event()
    busy.set()
    drain = Drain(str(drain_file), idle=lambda: not busy.is_set(), interval_s=0.01)
    try:
        assert not drain_file.exists() and not done.exists()
        with drain.execute() as draining:
            assert not draining
            drain_file.touch()
            busy.clear()
            time.sleep(0.2)
            assert not done.exists()  # this call is still taking its requests
        wait_until(done.exists)
        with drain.execute() as draining:
            assert draining
    finally:
        drain.shutdown()
    still_busy = Drain(str(tmp_path / "other"), idle=lambda: False, interval_s=0.01)
    try:
        (tmp_path / "other").touch()
        time.sleep(0.2)
        assert not (tmp_path / "other.done").exists()
    finally:
        still_busy.shutdown()
    with pytest.raises(ValueError, match="'drain_file': its directory .*missing does not exist"):
        TTSSettings(drain_file=str(tmp_path / "missing" / "drain"))


@pytest.mark.server
def test_a_drained_server_ends_its_streams_and_then_says_so(tiny_checkpoint):
    parameters = {"tts": {"text_layout": "interleaved"}}
    with start_server(tiny_checkpoint, parameters=parameters) as server:
        client = TTSClient(server.grpc_url)
        started, results = threading.Event(), {}

        def long_stream():
            results["long"] = client.synthesize(
                "A long answer that is still being spoken.",
                max_frames=FRAMES,
                ignore_eos=True,
                on_chunk=lambda chunk: started.set(),
            )

        speaker = threading.Thread(target=long_stream)
        speaker.start()
        assert started.wait(120)
        sequence = RawStream(server.grpc_url)  # an input stream, open across the drain
        sequence_id = uuid.uuid4().hex
        sequence.piece(sequence_id, "Words that", "open", start=True, max_frames=20, ignore_eos=True)
        time.sleep(0.5)
        drained = {}
        drainer = threading.Thread(target=lambda: drained.update(done=server.drain(120)))
        drainer.start()
        while not server.drain_file.exists():
            time.sleep(0.01)
        refused = client.synthesize("A new request.", max_frames=10)
        assert refused.error.startswith("server shutting down: not taking new requests")
        other = RawStream(server.grpc_url)
        other.piece(uuid.uuid4().hex, "A new input stream", "new", start=True, max_frames=10)
        assert other.next_error().startswith("server shutting down")
        other.close()
        assert drainer.is_alive()  # the stream and the open input stream are still in flight
        sequence.piece(sequence_id, " keep coming.", "end", end=True)
        speaker.join(120)
        drainer.join(120)
        long = results["long"]
        assert long.error is None and long.completed and long.playback.audio_s == pytest.approx(FRAMES / 12.5)
        assert sequence.audio_samples("open") == 20 * 1920
        sequence.close()
        assert drained["done"] and server.drain_file.with_name("drain.done").exists()
