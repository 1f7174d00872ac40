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

pytestmark = pytest.mark.server

FRAMES = 120


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
