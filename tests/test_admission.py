"""An admission's inputs packed on the host read back exactly through the device views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxtriton.engine.admission import ROW_SCALARS, AdmissionLayout
from voxtriton.engine.request import GenerationParams, Request
from voxtriton.engine.sampling import fold_seed
from voxtriton.models.text import Prompt

PAD, NO_CODEC = 151671, -1


def request(index: int, length: int, trailing: int, **sampling) -> Request:
    params = GenerationParams(
        temperature=0.9,
        top_k=50,
        top_p=0.8,
        repetition_penalty=1.05,
        sub_temperature=0.7,
        sub_top_k=30,
        sub_top_p=0.95,
        seed=2**63 + index,
        max_frames=100,
        **sampling,
    )
    prompt = Prompt(
        text_ids=list(range(1000 + index, 1000 + index + length)),
        codec_ids=[NO_CODEC] * (length - 2) + [2150 + index, 2151],
        trailing_text_ids=list(range(500, 500 + trailing)),
    )
    return Request(f"r{index}", prompt, params)


def test_views_read_what_pack_wrote():
    layout = AdmissionLayout(capacity=4, trailing_width=9)
    requests = [request(0, 5, 3, ignore_eos=True), request(1, 7, 8)]
    flat = torch.from_numpy(
        layout.pack(requests, first_row=37, batch=4, length=8, pad_text_id=PAD, no_codec=NO_CODEC)
    )
    assert flat.numel() == layout.size(4, 8)
    inputs = layout.views(flat, count=2, batch=4, length=8)
    assert inputs.first_row.tolist() == [37]
    for row, r in zip(inputs.scalars.tolist(), requests):
        values = dict(zip(ROW_SCALARS, row))
        for name in ROW_SCALARS[:-2]:
            assert values[name] == float(getattr(r.params, name)), name
        assert values["seed"] == fold_seed(r.params.seed) and values["position"] == len(r.prompt.text_ids)
    assert inputs.trailing.tolist() == [[500, 501, 502] + [PAD] * 6, list(range(500, 508)) + [PAD]]
    assert inputs.last_index.tolist() == [4, 6, 0, 0]  # padding rows read position 0
    text, codec = inputs.text.numpy(), inputs.codec.numpy()
    np.testing.assert_array_equal(text[0], [1000, 1001, 1002, 1003, 1004, 0, 0, 0])
    np.testing.assert_array_equal(text[1], [1001 + i for i in range(7)] + [0])
    assert not text[2:].any() and (codec[2:] == NO_CODEC).all()
    np.testing.assert_array_equal(codec[1], [NO_CODEC] * 5 + [2151, 2151, NO_CODEC])


def test_views_of_a_larger_buffer_keep_the_per_request_offsets():
    """The static buffer is sized for the largest bucket; smaller admissions use a prefix of it."""
    layout = AdmissionLayout(capacity=8, trailing_width=4)
    buffer = torch.zeros(layout.size(8, 64), dtype=torch.long)
    host = torch.from_numpy(
        layout.pack([request(3, 10, 2)], first_row=5, batch=1, length=16, pad_text_id=PAD, no_codec=NO_CODEC)
    )
    buffer[: host.numel()] = host
    inputs = layout.views(buffer, count=1, batch=1, length=16)
    assert inputs.first_row.item() == 5 and inputs.scalars[0, ROW_SCALARS.index("top_k")].item() == 50
    assert inputs.text[0, :10].tolist() == list(range(1003, 1013)) and inputs.last_index.tolist() == [9]


def test_pack_refuses_more_requests_than_the_layout_holds():
    layout = AdmissionLayout(capacity=2, trailing_width=4)
    with pytest.raises(ValueError, match="3 requests padded to 4 does not fit 2"):
        layout.pack(
            [request(i, 4, 1) for i in range(3)],
            first_row=0,
            batch=4,
            length=4,
            pad_text_id=PAD,
            no_codec=NO_CODEC,
        )
