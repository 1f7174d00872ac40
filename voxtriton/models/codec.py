"""The 12 Hz codec decoder (Qwen3-TTS-Tokenizer-12Hz), streaming with explicit state.

Every layer of this decoder is causal with no lookahead: causal convolutions, causal transposed
convolutions and a sliding-window causal transformer. Each frame therefore becomes exactly
`samples_per_frame` samples as soon as it exists, and decoding in chunks is the same computation
as decoding whole, provided each layer gets the tail of its input from the previous chunk.
`CodecState` holds those tails (and the transformer's key/value window) as plain tensors, so a
chunk of any request can be decoded by any process: the state travels with the call.

The layers after the transformer see only a few frames back (`CodecDecoder.back_frames`). Priming a
stream with an in-context voice's reference codes, whose audio is dropped, therefore runs the
transformer over every reference frame but the convolutions only over the last few: the same state
for a fraction of the work.

Module names mirror the official `speech_tokenizer/model.safetensors` (`decoder.*`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import codec as kernels
from .config import CodecConfig
from .layers import DecoderStack


@dataclass(frozen=True)
class StateSlot:
    name: str
    shape: tuple[int, ...]  # without the batch dimension


class StreamState:
    """The per-request state of one decode call: named tensors with a leading batch dimension."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.updated: dict[str, torch.Tensor] = {}

    def take(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def put(self, name: str, value: torch.Tensor) -> None:
        self.updated[name] = value


class StreamingModule(nn.Module):
    """A layer that carries state between chunks under a unique name (its module path)."""

    state_name: str = ""

    def state_slots(self) -> list[StateSlot]:
        raise NotImplementedError

    def _input(
        self, x: torch.Tensor, state: StreamState, keep: int, activation=None, tail: int = 0
    ) -> torch.Tensor:
        """activation(x) (or x), after the carried history when the layer keeps one (`keep` > 0) and
        before `tail` zero columns: the last `keep` columns of history and x become the next chunk's
        history. The activation writes its output between the history and the tail itself, so the
        padding costs no extra pass over the activation."""
        if not keep:
            return activation(x) if activation is not None else x
        history = state.take(self.state_name)
        if activation is not None:
            padded = activation(x, history=history, tail=tail)
        else:
            padded = kernels.pad_time(x, history, tail)
        end = padded.shape[-1] - tail
        state.put(self.state_name, padded[..., end - keep : end])
        return padded


class SnakeBeta(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        # Log-scale parameters, as the checkpoint stores them.
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
        tail: int = 0,
    ) -> torch.Tensor:
        """SnakeBeta of x (+ the previous convolution's bias), prefixed along time by `history` and
        followed by `tail` zero columns."""
        return kernels.snake(x, self.alpha, self.beta, bias, history, tail)


class CausalConv(StreamingModule):
    """Conv1d (stride 1) that sees only the past: the state is the last (receptive field - 1) inputs."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1
    ):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def state_slots(self):
        return [StateSlot(self.state_name, (self.conv.in_channels, self.context))] if self.context else []

    def forward(
        self, x: torch.Tensor, state: StreamState, activation: SnakeBeta | None = None, add_bias: bool = True
    ) -> torch.Tensor:
        """conv(activation(x)) (or conv(x)) over the carried history. add_bias=False leaves this
        convolution's bias to the caller, which fuses it into what follows."""
        conv = self.conv
        bias = conv.bias if add_bias else None
        dilation = conv.dilation[0]
        if dilation == 1 or not self.context:
            x = self._input(x, state, self.context, activation)
            return F.conv1d(x, conv.weight, bias, dilation=conv.dilation, groups=conv.groups)
        # cuDNN's dilated kernels are slower than its dense ones: time viewed as [length / d, d] (zero
        # columns pad it, their outputs dropped) makes the d phases one dilation-1 convolution.
        frames = x.shape[-1]
        x = self._input(x, state, self.context, activation, tail=-frames % dilation)
        batch, channels, length = x.shape
        phases = x.view(batch, channels, length // dilation, dilation)
        y = F.conv2d(phases, conv.weight[..., None], bias, groups=conv.groups)
        return y.flatten(2)[..., :frames]

    def pointwise(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + conv(x) for a kernel-size-1 convolution: a batched matrix product, then the bias
        and the residual in one pass."""
        weight = self.conv.weight[..., 0].expand(x.shape[0], -1, -1)  # a stride-0 batch, no copy
        return kernels.add_channel_bias(torch.bmm(weight, x), self.conv.bias, residual)


class CausalTransConv(StreamingModule):
    """ConvTranspose1d trimmed on the right, so frame t's output depends on frames t and t-1 only.

    With kernel k and stride s (s <= k <= 2s), the previous input frame overlaps this one's output
    by k - s samples; the state is that previous frame.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        groups: int = 1,
        bias: bool = True,
    ):
        super().__init__()
        if not stride <= kernel_size <= 2 * stride:
            raise ValueError(
                f"causal transposed conv needs stride <= kernel <= 2*stride, got k={kernel_size} s={stride}"
            )
        self.conv = nn.ConvTranspose1d(
            in_channels, out_channels, kernel_size, stride=stride, groups=groups, bias=bias
        )
        self.stride = stride
        self.overlaps = kernel_size > stride

    def state_slots(self):
        return [StateSlot(self.state_name, (self.conv.in_channels, 1))] if self.overlaps else []

    def forward(
        self, x: torch.Tensor, state: StreamState, activation: SnakeBeta | None = None
    ) -> torch.Tensor:
        """conv(activation(x)) (or conv(x)) after the previous frame, trimmed; the bias is added to the
        trimmed output in the same pass that makes it contiguous."""
        frames = x.shape[-1]
        x = self._input(x, state, 1 if self.overlaps else 0, activation)
        y = F.conv_transpose1d(x, self.conv.weight, None, stride=self.stride, groups=self.conv.groups)
        first = self.stride if self.overlaps else 0
        y = y[..., first : first + self.stride * frames]
        return y.contiguous() if self.conv.bias is None else kernels.add_channel_bias(y, self.conv.bias)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        h = self.dwconv(x, state).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        hidden = self.act2(
            self.conv1(x, state, activation=self.act1, add_bias=False), bias=self.conv1.conv.bias
        )
        return self.conv2.pointwise(hidden, residual=x)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate)]
            + [ResidualUnit(out_dim, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        x = self.block[1](x, state, activation=self.block[0])
        for unit in self.block[2:]:
            x = unit(x, state)
        return x


class WindowKV(StreamingModule):
    """Keys/values of the last (window - 1) frames for every pre-transformer layer."""

    def __init__(self, layers: int, kv_heads: int, window: int, head_dim: int):
        super().__init__()
        self.shape = (layers, kv_heads, window - 1, head_dim)
        self.current: StreamState | None = None

    def state_slots(self):
        return [
            StateSlot(self.state_name + ".keys", self.shape),
            StateSlot(self.state_name + ".values", self.shape),
        ]

    def update(self, layer, keys, values):
        state = self.current
        old_keys = state.take(self.state_name + ".keys")[:, layer]
        old_values = state.take(self.state_name + ".values")[:, layer]
        keys, values = torch.cat((old_keys, keys), dim=2), torch.cat((old_values, values), dim=2)
        keep = self.shape[2]
        self._new_keys.append(keys[:, :, -keep:])
        self._new_values.append(values[:, :, -keep:])
        return keys, values

    def begin(self, state: StreamState) -> "WindowKV":
        self.current, self._new_keys, self._new_values = state, [], []
        return self

    def end(self) -> None:
        self.current.put(self.state_name + ".keys", torch.stack(self._new_keys, dim=1))
        self.current.put(self.state_name + ".values", torch.stack(self._new_values, dim=1))
        self.current = None


def window_mask(start: torch.Tensor, frames: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, T] of `frames` new steps from `start` [B], and the mask [B, 1, T, window - 1 + T]
    over the carried (window - 1) keys and the new ones: causal, within the window, none before 0."""
    keep = window - 1
    positions = start[:, None] + torch.arange(frames, device=start.device)
    key_positions = start[:, None] - keep + torch.arange(keep + frames, device=start.device)
    query, key = positions[:, :, None], key_positions[:, None, :]
    mask = (key >= 0) & (key <= query) & (key > query - window)
    return positions, mask[:, None]


class PreTransformer(DecoderStack):
    def __init__(self, cfg: CodecConfig):
        t = cfg.transformer
        super().__init__(t, layer_scale=cfg.layer_scale)
        self.window = t.sliding_window
        self.input_proj = nn.Linear(cfg.latent_dim, t.hidden_size)
        self.output_proj = nn.Linear(t.hidden_size, cfg.latent_dim)
        self.kv = WindowKV(t.num_layers, t.num_kv_heads, t.sliding_window, t.head_dim)

    def stream(self, x: torch.Tensor, start: torch.Tensor, state: StreamState) -> torch.Tensor:
        """x [B, T, latent]; start [B]: absolute frame index of x[:, 0] (RoPE positions)."""
        positions, mask = window_mask(start, x.shape[1], self.window)
        hidden = super().forward(self.input_proj(x), positions, self.kv.begin(state), mask)
        self.kv.end()
        return self.output_proj(hidden)


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, codebook: Codebook):
        super().__init__()
        self._codebook = codebook


class ResidualQuantizer(nn.Module):
    def __init__(self, count: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.vq = nn.Module()
        self.vq.layers = nn.ModuleList(VectorQuantizer(Codebook(size, dim)) for _ in range(count))
        # input_proj belongs to the encoder side of the tokenizer; it is in the checkpoint and kept
        # so loading stays strict, but decoding never uses it.
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, T] -> [B, io_dim, T]"""
        total = 0
        for index, layer in enumerate(self.vq.layers):
            total = total + F.embedding(codes[:, index], layer._codebook.table()).transpose(1, 2)
        return self.output_proj(total)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        semantic = cfg.num_semantic_quantizers
        self.semantic = semantic
        self.rvq_first = ResidualQuantizer(semantic, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualQuantizer(
            cfg.num_quantizers - semantic, cfg.codebook_size, dim, cfg.codebook_dim
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, : self.semantic]) + self.rvq_rest.decode(
            codes[:, self.semantic :]
        )


class CodecDecoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.config = cfg
        self.quantizer = SplitQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, kernel_size=3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [CausalTransConv(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)]
            )
            for r in cfg.upsampling_ratios
        )
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], rate) for i, rate in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)]
        )
        for name, module in self.named_modules():
            if isinstance(module, StreamingModule):
                module.state_name = name
        back = [
            m for m in (*self.upsample.modules(), *self.decoder.modules()) if isinstance(m, StreamingModule)
        ]
        self.back_state_names = {slot.name for module in back for slot in module.state_slots()}
        self.back_frames = _look_back_frames(back)

    def state_slots(self) -> list[StateSlot]:
        return [slot for m in self.modules() if isinstance(m, StreamingModule) for slot in m.state_slots()]

    def forward(self, codes: torch.Tensor, start: torch.Tensor, state: StreamState) -> torch.Tensor:
        """codes [B, T, num_quantizers] (T frames of every request) -> waveform [B, T * samples_per_frame]."""
        return self.back(self.front(codes, start, state), state)

    def front(self, codes: torch.Tensor, start: torch.Tensor, state: StreamState) -> torch.Tensor:
        """The quantizer, the input convolution and the transformer: codes [B, T, Q] -> [B, latent, T]."""
        if codes.shape[-1] != self.config.num_quantizers:
            raise ValueError(
                f"expected {self.config.num_quantizers} codebooks per frame, got {codes.shape[-1]}"
            )
        hidden = self.pre_conv(self.quantizer.decode(codes.transpose(1, 2)), state)
        return self.pre_transformer.stream(hidden.transpose(1, 2), start, state).transpose(1, 2)

    def back(self, hidden: torch.Tensor, state: StreamState) -> torch.Tensor:
        """The upsampling and the convolutional decoder: [B, latent, T] -> [B, T * samples_per_frame]."""
        for transposed, convnext in self.upsample:
            hidden = convnext(transposed(hidden, state), state)
        wav = self.decoder[0](hidden, state)
        for block in self.decoder[1:-2]:
            wav = block(wav, state)
        wav = self.decoder[-1](wav, state, activation=self.decoder[-2])
        return wav.squeeze(1).clamp(-1.0, 1.0)


def _look_back_frames(layers: list[StreamingModule]) -> int:
    """How many frames back the last output of `layers` (the layers after the transformer, in
    order) can depend on, rounded up: each convolution looks back its context at its own rate, each
    overlapping transposed convolution one input step; one frame more for the frame itself."""
    frames, samples_per_frame = 0.0, 1
    for layer in layers:
        if isinstance(layer, CausalTransConv):
            frames += (1 if layer.overlaps else 0) / samples_per_frame
            samples_per_frame *= layer.stride
        elif isinstance(layer, CausalConv):
            frames += layer.context / samples_per_frame
    return math.ceil(frames) + 1


class PackedState:
    """A codec's per-stream state (its `slots`) packed into one [B, state_size] tensor and back, so
    it travels between processes as a single tensor."""

    slots: list[StateSlot]

    def unpack(self, packed: torch.Tensor) -> StreamState:
        tensors, offset = {}, 0
        for slot in self.slots:
            size = math.prod(slot.shape)
            tensors[slot.name] = packed[:, offset : offset + size].view(-1, *slot.shape)
            offset += size
        return StreamState(tensors)

    def pack(self, state: StreamState) -> torch.Tensor:
        """The updated slots, and the others as they came."""
        tensors = [state.updated.get(slot.name, state.tensors[slot.name]) for slot in self.slots]
        return torch.cat([tensor.reshape(tensor.shape[0], -1) for tensor in tensors], dim=1)


class CodecModel(PackedState, nn.Module):
    """Root module so parameter names match the checkpoint's `decoder.*` prefix."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.config = cfg
        self.decoder = CodecDecoder(cfg)
        self.slots = self.decoder.state_slots()
        self.state_size = sum(math.prod(slot.shape) for slot in self.slots)

    def new_state(self, batch: int, device=None, dtype=None) -> torch.Tensor:
        """A fresh stream's state, packed: [B, state_size] zeros (zero padding = silence before frame 0)."""
        param = self.decoder.pre_conv.conv.weight
        return torch.zeros(batch, self.state_size, device=device or param.device, dtype=dtype or param.dtype)

    @torch.inference_mode()
    def decode(
        self, codes: torch.Tensor, start: torch.Tensor, packed_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the next chunk of B streams.

        codes: [B, T, 16] int64, the next T frames of each stream; start: [B] int64, frames each
        stream has decoded before; packed_state: [B, state_size] from `new_state` or a previous
        call. Returns (waveform [B, T * samples_per_frame], next packed state).
        """
        state = self._unpacked(packed_state)
        wav = self.decoder(codes.long(), start.long(), state)
        return wav, self.pack(state)

    def _unpacked(self, packed_state: torch.Tensor) -> StreamState:
        """A packed state (a pool's float32 rows, say) in the decoder's dtype, unpacked."""
        return self.unpack(packed_state.to(self.decoder.pre_conv.conv.weight.dtype))

    @torch.inference_mode()
    def front(
        self, codes: torch.Tensor, start: torch.Tensor, packed_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode`'s first half (`CodecDecoder.front`): (hidden [B, latent, T], the packed state with
        that half's part advanced)."""
        state = self._unpacked(packed_state)
        hidden = self.decoder.front(codes.long(), start.long(), state)
        return hidden, self.pack(state)

    @torch.inference_mode()
    def back(
        self, hidden: torch.Tensor, packed_state: torch.Tensor, fresh: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode`'s second half over `front`'s hidden frames: (waveform, the packed state with this
        half's part advanced). `fresh`: this half starts from a fresh state, whatever the row holds."""
        state = self._unpacked(packed_state)
        if fresh:
            names = self.decoder.back_state_names
            tensors = {name: torch.zeros_like(t) if name in names else t for name, t in state.tensors.items()}
            state = StreamState(tensors)
        wav = self.decoder.back(hidden, state)
        return wav, self.pack(state)

    @property
    def back_frames(self) -> int:
        return self.decoder.back_frames

    def prime(self, codes: torch.Tensor, start: torch.Tensor, packed_state: torch.Tensor) -> torch.Tensor:
        """The next packed state `decode` returns for these codes, without their audio (an in-context
        voice's reference codes, whose audio is dropped): the second half runs over the last
        `back_frames` frames only, from a fresh state, which leaves it the state the whole decode
        would (nothing earlier reaches it)."""
        hidden, packed_state = self.front(codes, start, packed_state)
        if hidden.shape[-1] <= self.back_frames:
            return self.back(hidden, packed_state)[1]
        return self.back(hidden[..., -self.back_frames :], packed_state, fresh=True)[1]
