"""The Base model's speaker encoder: an ECAPA-TDNN that maps a reference recording to one x-vector.

The x-vector takes the place of a preset speaker's codec token in the talker prompt. Module names
mirror the official checkpoint (`speaker_encoder.blocks.0.conv.weight`, ...), so loading is a
name-for-name copy. Its input is the 128-bin log-mel spectrogram of 24 kHz audio computed here as
the reference implementation computes it (Slaney mel filterbank, Hann window, reflect padding).

Recordings of different lengths go in one batch, zero-padded to a common length, with their own
`lengths`: each row's tail is refilled with the reflection of its own end before every layer that
reads past it (the spectrogram's frames and the wider convolutions), and the averages over time (the
squeeze-excitation gates, the attentive statistics) count a row's own frames only. A row then gets
the x-vector it gets alone, up to float rounding, provided the common length leaves `tail_margin`
samples after every row.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import SpeakerEncoderConfig

N_FFT, HOP, WINDOW = 1024, 256, 1024
PAD = (N_FFT - HOP) // 2  # reflected at each end of a recording before its spectrogram


def mel_frames(samples):
    """Spectrogram frames of a recording (an int, or a tensor of lengths)."""
    return (samples + 2 * PAD - N_FFT) // HOP + 1


def _reflect_tail(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] with each row's positions from its length on refilled with the reflection of its
    end (position length + j holds length - 2 - j), as reflect padding of the row alone would be."""
    positions = torch.arange(x.shape[-1], device=x.device)
    ends = lengths[:, None]
    index = torch.where(positions < ends, positions, (2 * (ends - 1) - positions).clamp(min=0))
    return x.gather(2, index[:, None, :].expand(-1, x.shape[1], -1))


def _frame_mask(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, 1, T]: 1 on each row's own frames of x [B, C, T], 0 after them."""
    return (torch.arange(x.shape[-1], device=x.device) < lengths[:, None]).to(x.dtype)[:, None]


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27.0) * (mel - 15.0)), mel * (200.0 / 3))


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters with Slaney area normalisation (librosa's default)."""
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


class MelSpectrogram(nn.Module):
    """Log-mel frames [B, T, mels] of waveforms [B, samples] (fp32)."""

    def __init__(self, mels: int, sample_rate: int):
        super().__init__()
        self.bank_np = mel_filterbank(sample_rate, N_FFT, mels, 0.0, sample_rate / 2)
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if audio.device not in self.tables:
            bank = torch.from_numpy(self.bank_np).to(audio.device)
            self.tables[audio.device] = (bank, torch.hann_window(WINDOW, device=audio.device))
        bank, window = self.tables[audio.device]
        if lengths is not None:
            audio = _reflect_tail(audio[:, None], lengths)[:, 0]
        audio = F.pad(audio[:, None], (PAD, PAD), mode="reflect")[:, 0]
        spec = torch.stft(audio, N_FFT, HOP, WINDOW, window, center=False, return_complex=True, onesided=True)
        magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
        return torch.log(torch.clamp(bank @ magnitude, min=1e-5)).transpose(1, 2)


def _conv(in_channels: int, out_channels: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(
        in_channels, out_channels, kernel, dilation=dilation, padding="same", padding_mode="reflect"
    )


class TDNNBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _conv(in_channels, out_channels, kernel, dilation)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if lengths is not None and self.conv.kernel_size[0] > 1:
            x = _reflect_tail(x, lengths)  # a "same" convolution reads past a row's end
        return F.relu(self.conv(x))

    @property
    def reach(self) -> int:
        """Frames past a position its output reads (its right padding)."""
        span = self.conv.dilation[0] * (self.conv.kernel_size[0] - 1)
        return span - span // 2


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        width = channels // scale
        self.blocks = nn.ModuleList(TDNNBlock(width, width, kernel, dilation) for _ in range(scale - 1))
        self.scale = scale

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i, block in enumerate(self.blocks):
            out.append(block(parts[i + 1] if i == 0 else parts[i + 1] + out[-1], lengths))
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if lengths is None:
            mean = x.mean(dim=2, keepdim=True)
        else:
            mean = (x * _frame_mask(x, lengths)).sum(dim=2, keepdim=True) / lengths[:, None, None]
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(mean))))
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, cfg: SpeakerEncoderConfig, index: int):
        super().__init__()
        in_ch, out_ch = cfg.enc_channels[index - 1], cfg.enc_channels[index]
        self.tdnn1 = TDNNBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(
            out_ch, cfg.enc_res2net_scale, cfg.enc_kernel_sizes[index], cfg.enc_dilations[index]
        )
        self.tdnn2 = TDNNBlock(out_ch, out_ch, 1, 1)
        self.se_block = SqueezeExcitation(out_ch, cfg.enc_se_channels)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.tdnn2(self.res2net_block(self.tdnn1(x), lengths))
        return self.se_block(hidden, lengths) + x


class AttentiveStatisticsPooling(nn.Module):
    """Mean and standard deviation over time, weighted by attention that sees the global statistics."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    @staticmethod
    def _statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (weights * x).sum(2)
        std = torch.sqrt((weights * (x - mean[..., None]).pow(2)).sum(2).clamp(1e-12))
        return mean, std

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if lengths is None:
            uniform = torch.full_like(x[:, :1], 1.0 / x.shape[-1])
        else:
            mask = _frame_mask(x, lengths)
            x = x * mask  # past a row's frames: zeros, weighted by zero
            uniform = mask / lengths[:, None, None]
        mean, std = self._statistics(x, uniform)
        context = torch.cat([x, mean[..., None].expand_as(x), std[..., None].expand_as(x)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context)))
        if lengths is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attention = torch.softmax(scores, dim=2)
        mean, std = self._statistics(x, attention)
        return torch.cat((mean, std), dim=1)[..., None]


class SpeakerEncoder(nn.Module):
    """Log-mel frames [B, T, mels] -> x-vectors [B, enc_dim]."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        channels, kernels, dilations = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([TDNNBlock(cfg.mel_dim, channels[0], kernels[0], dilations[0])])
        self.blocks.extend(SERes2NetBlock(cfg, i) for i in range(1, len(channels) - 1))
        self.mfa = TDNNBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], cfg.enc_attention_channels)
        self.fc = _conv(channels[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """lengths [B]: each row's own frames (None: all)."""
        x = mels.transpose(1, 2)
        outputs = []
        for block in self.blocks:
            x = block(x, lengths)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1), lengths)
        return self.fc(self.asp(x, lengths))[..., 0]

    @property
    def reach(self) -> int:
        return max(block.reach for block in self.modules() if isinstance(block, TDNNBlock))


class SpeakerEncoderRoot(nn.Module):
    """Root module so parameter names carry the checkpoint's `speaker_encoder.` prefix."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.config = cfg
        self.mel = MelSpectrogram(cfg.mel_dim, cfg.sample_rate)
        self.speaker_encoder = SpeakerEncoder(cfg)

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Waveforms [B, samples] at 24 kHz -> x-vectors [B, enc_dim]. lengths [B]: each row's
        samples (None: all), with at least `tail_margin` samples after each."""
        mels = self.mel(audio.float(), lengths).to(self.speaker_encoder.fc.weight.dtype)
        return self.speaker_encoder(mels, None if lengths is None else mel_frames(lengths))

    @property
    def tail_margin(self) -> int:
        """Samples a batch must hold past each row's end: what its spectrogram's last frame and the
        widest convolution read past it."""
        return max(PAD, HOP * (self.speaker_encoder.reach + 1))
