"""Chunked decoding with carried state equals decoding whole; the state is plain, movable tensors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from voxtriton.models.loader import load_codec

FRAMES = 100


@pytest.fixture(scope="module")
def codec(tiny_checkpoint):
    return load_codec(tiny_checkpoint)


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 2048, (2, FRAMES, 16), generator=torch.Generator().manual_seed(11))


def decode_in_chunks(codec, codes, schedule, transport=lambda state: state):
    batch = codes.shape[0]
    state, start, pieces = codec.new_state(batch), 0, []
    for size in schedule:
        chunk = codes[:, start : start + size]
        if chunk.shape[1] == 0:
            break
        wav, state = codec.decode(chunk, torch.full((batch,), start), transport(state))
        pieces.append(wav)
        start += chunk.shape[1]
    assert start == codes.shape[1], "schedule must cover every frame"
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize(
    "schedule",
    [
        [1] * FRAMES,
        [2] * 50,
        [7] * 15,
        [25] * 4,
        [3, 1, 10, 25, 2, 40, 19],
        [FRAMES],
    ],
    ids=["1", "2", "7", "25", "mixed", "whole"],
)
def test_chunked_equals_whole(codec, codes, schedule):
    whole, _ = codec.decode(codes, torch.zeros(2, dtype=torch.long), codec.new_state(2))
    assert whole.shape == (2, FRAMES * 1920)
    assert whole.abs().max() > 0.05
    chunked = decode_in_chunks(codec, codes, schedule)
    assert (chunked - whole).abs().max().item() <= 1e-4


def test_frames_after_the_end_leave_the_audio_before_them_unchanged(codec, codes):
    """Why a stream's short last chunk may be decoded padded to a captured size (Chunk.decode_frames)."""
    start = torch.zeros(2, dtype=torch.long)
    exact, _ = codec.decode(codes[:, :7], start, codec.new_state(2))
    padding = codes[:, 6:7].expand(2, 9, 16)
    padded, _ = codec.decode(torch.cat([codes[:, :7], padding], dim=1), start, codec.new_state(2))
    assert padded.shape == (2, 16 * 1920)
    assert (padded[:, : 7 * 1920] - exact).abs().max().item() <= 1e-5


def test_state_survives_serialisation_between_calls(codec, codes):
    """State handed to "another process": through bytes, as a BLS call would carry it."""

    def through_bytes(state: torch.Tensor) -> torch.Tensor:
        buffer = io.BytesIO()
        np.save(buffer, state.numpy())
        return torch.from_numpy(np.load(io.BytesIO(buffer.getvalue())))

    direct = decode_in_chunks(codec, codes, [5] * 20)
    carried = decode_in_chunks(codec, codes, [5] * 20, through_bytes)
    assert torch.equal(direct, carried)


def test_rows_are_independent(codec, codes):
    """Each row of a batched call decodes as if alone (no cross-talk between streams)."""
    both, _ = codec.decode(codes[:, :10], torch.zeros(2, dtype=torch.long), codec.new_state(2))
    alone, _ = codec.decode(codes[1:, :10], torch.zeros(1, dtype=torch.long), codec.new_state(1))
    assert (both[1] - alone[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("frames, start", [(FRAMES, 0), (6, 0), (40, 17)])
def test_priming_leaves_the_state_a_decode_does(codec, codes, frames, start, monkeypatch):
    """An in-context voice's reference codes: the transformer over every frame, the convolutions over
    the last `back_frames` only (from a fresh state); a reference no longer than that, and one after
    earlier frames (start > 0), decode whole. Fewer look-back frames than `back_frames` would change
    the state: the priming's shortcut rests on that bound."""
    state = codec.new_state(2)
    if start:
        _, state = codec.decode(codes[:, :start], torch.zeros(2, dtype=torch.long), state)
    begin, reference = torch.full((2,), start), codes[:, start : start + frames]
    _, decoded = codec.decode(reference, begin, state)
    assert (codec.prime(reference, begin, state) - decoded).abs().max().item() <= 1e-5
    back, widths = codec.decoder.back, []

    def recorded_back(hidden, state):
        widths.append(hidden.shape[-1])
        return back(hidden, state)

    monkeypatch.setattr(codec.decoder, "back", recorded_back)
    codec.prime(reference, begin, state)
    assert widths == [min(frames, codec.decoder.back_frames)]
    if frames > codec.decoder.back_frames:
        monkeypatch.setattr(codec.decoder, "back_frames", codec.decoder.back_frames // 2)
        assert (codec.prime(reference, begin, state) - decoded).abs().max().item() > 1e-3


def test_state_layout(codec):
    assert codec.new_state(3).shape == (3, codec.state_size)
    names = [slot.name for slot in codec.slots]
    assert "pre_transformer.kv.keys" in names and len(names) == len(set(names))


@pytest.mark.parametrize(
    "frames, pieces",
    [(125, (25,) * 5), (126, (25, 25, 25, 25, 16, 8, 2)), (27, (25, 2)), (3, None), (0, ())],
)
def test_a_length_splits_into_the_fewest_captured_lengths(frames, pieces):
    """How a graphed codec decodes a length it did not capture (tests/test_gpu.py runs it)."""
    from voxtriton.engine.codec_runner import split_frames

    assert split_frames(frames, (2, 4, 8, 16, 25)) == pieces


def test_codec_speed_times_each_shape_and_the_service_call(tmp_path, tiny_checkpoint):
    """`benchmarks/codec_speed.py --service` on a CPU: a time per shape for the runner's call and for
    the codec service's whole call (codes on the host, a state pool, the audio back)."""
    out = tmp_path / "codec_speed.json"
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "benchmarks" / "codec_speed.py"),
            "--checkpoint",
            str(tiny_checkpoint),
            "--device",
            "cpu",
            "--shapes",
            "1x1,2x2",
            "--repeat",
            "2",
            "--service",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["gpu"] is None
    for times in (result["ms"], result["service_ms"]):
        assert times.keys() == {"1x1", "2x2"} and all(ms > 0 for ms in times.values())
