"""A reference-recording encoder at fixed shapes, as CUDA graphs on a GPU.

Run eagerly, the encoders of a reference recording are hundreds of small kernels (the speech
tokenizer's: a SEANet stack, an 8-layer transformer, 16 quantizers; the speaker encoder: an
ECAPA-TDNN), so at batch 1 they cost about the same for 3 s as for 30 s of audio: launches. Here
recordings are zero-padded to a length bucket and a batch bucket, each row with its own length
(each encoder gives a row what it gets alone, see `models.speech_encoder` and
`models.speaker_encoder`), so on a GPU each (batch, length) bucket is one CUDA graph, captured at
start: one launch per batch of recordings. A graph keeps the memory of its largest activations
(the speech encoder's about 0.7 GB per 30 s row on the CPU, in the pool its graphs share), so graphs go up to
`GRAPH_BATCHES[-1]` rows and a larger batch replays them in pieces. The eager path (a CPU, or no
graphs) pads the same way: one code path, the one the graphs run.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch
from torch import nn

from .codec_runner import capture_stream

LENGTH_BUCKETS_S = (2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30)  # recordings from 1 to 30 s
GRAPH_BATCHES = (1, 2)


class EncoderRunner:
    def __init__(
        self,
        model: nn.Module,
        row_output: Callable[[torch.Tensor, int], torch.Tensor],
        margin: int = 0,
        graphs: bool = True,
    ):
        """model: an encoder taking (audio [B, samples], lengths [B]), with `config.sample_rate`.
        row_output: a row of its output, and the row's length -> the recording's result. margin:
        samples a row needs after its end. graphs: capture every bucket now (on a GPU only)."""
        self.model, self.row_output, self.margin = model, row_output, margin
        self.device = next(model.parameters()).device
        self.lengths = [int(s * model.config.sample_rate) + margin for s in LENGTH_BUCKETS_S]
        self.graphs: dict[tuple[int, int], tuple] = {}  # -> (graph, audio and lengths inputs, output)
        self.pool = None
        self.lock = threading.Lock()  # one batch at a time: the graphs' inputs and outputs are shared
        if graphs and self.device.type == "cuda":
            for length in reversed(self.lengths):  # largest first: the shared pool is sized once
                for batch in reversed(GRAPH_BATCHES):
                    self._capture(batch, length)

    @torch.inference_mode()
    def _capture(self, batch: int, length: int) -> None:
        audio = torch.zeros(batch, length, device=self.device)
        lengths = torch.full((batch,), length - self.margin, device=self.device)
        for _ in range(2):
            self.model(audio, lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream(self.device)):
            output = self.model(audio, lengths)
        self.pool = graph.pool()
        self.graphs[(batch, length)] = (graph, audio, lengths, output)

    @torch.inference_mode()
    def run(self, waveforms: list[np.ndarray]) -> list[torch.Tensor]:
        """Each recording's result on the device, queued on the current stream."""
        results = []
        with self.lock:
            for start in range(0, len(waveforms), GRAPH_BATCHES[-1]):
                results += self._run_batch(waveforms[start : start + GRAPH_BATCHES[-1]])
        return results

    def _run_batch(self, waveforms: list[np.ndarray]) -> list[torch.Tensor]:
        longest = max(len(waveform) for waveform in waveforms) + self.margin
        length = next((n for n in self.lengths if n >= longest), longest)
        batch = next(b for b in GRAPH_BATCHES if b >= len(waveforms))
        audio = torch.zeros(batch, length)
        lengths = torch.full((batch,), length - self.margin)  # padding rows: silence
        for row, waveform in enumerate(waveforms):
            audio[row, : len(waveform)] = torch.from_numpy(waveform)
            lengths[row] = len(waveform)
        entry = self.graphs.get((batch, length))
        if entry is None:
            output = self.model(audio.to(self.device), lengths.to(self.device))
        else:
            graph, static_audio, static_lengths, static_output = entry
            static_audio.copy_(audio)
            static_lengths.copy_(lengths)
            graph.replay()
            output = static_output.clone()  # the next replay overwrites it, before callers read it
        return [self.row_output(output[row], len(waveform)) for row, waveform in enumerate(waveforms)]
