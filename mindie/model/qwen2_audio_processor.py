"""Qwen2-Audio's input features: transformers' `WhisperFeatureExtractor` (the torch path it takes
when torch is installed: STFT with a periodic Hann window, Slaney mel filters, log10, a floor 8
below the maximum, scaled to about [-1, 1]) over audio zero-padded to the 30 s window, and
`Qwen2AudioProcessor`'s token count from the feature mask.

Only the frames the encoder's kept outputs depend on are kept: output position i of the second
(stride 2) convolution reads frames up to 2i + 2, so frames [0, 2 * positions + 1) fix every
embedding, padding frames at the edge included (their values depend on the whole clip's maximum).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AudioSpec:
    """preprocessor_config.json's WhisperFeatureExtractor settings."""

    feature_size: int = 128  # mel bins
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30  # seconds: the encoder's window
    n_fft: int = 400

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @staticmethod
    def from_hf_dir(path: str) -> AudioSpec:
        file = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(file):
            return AudioSpec()
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
        if raw.get("dither") or raw.get("do_normalize"):
            raise ValueError(f"{file}: dither and do_normalize are not supported (Qwen2-Audio sets neither)")
        defaults = AudioSpec()
        return AudioSpec(**{k: int(raw.get(k, getattr(defaults, k))) for k in
                            ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft")})


@dataclass(frozen=True)
class AudioInput:
    """One clip, preprocessed: the log-mel frames the encoder reads and its token count."""

    features: np.ndarray  # float32 [feature_size, frames]: the frames its kept outputs read
    num_positions: int  # encoder positions before the pool: (valid frames - 1) // 2 + 1
    num_tokens: int  # after the pool: what the prompt's <|AUDIO|> expands to
    content_hash: bytes


def mel_filters(spec: AudioSpec) -> np.ndarray:
    """float64 [n_fft // 2 + 1, feature_size]: transformers' mel_filter_bank(min 0 Hz, max 8000 Hz,
    norm="slaney", mel_scale="slaney"), as WhisperFeatureExtractor builds it."""
    def to_mel(f: np.ndarray) -> np.ndarray:
        logstep = 27.0 / np.log(6.4)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * logstep, 3.0 * f / 200.0)

    def to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)

    bins = spec.n_fft // 2 + 1
    mels = np.linspace(to_mel(np.float64(0.0)), to_mel(np.float64(8000.0)), spec.feature_size + 2)
    centers = to_hz(mels)
    fft_freqs = np.linspace(0, spec.sampling_rate // 2, bins)
    slopes = centers[None, :] - fft_freqs[:, None]
    diff = np.diff(centers)
    filters = np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
    return filters * (2.0 / (centers[2:] - centers[:-2]))[None, :]


def num_audio_tokens(frames: int) -> tuple[int, int]:
    """(encoder positions, tokens) for `frames` valid feature frames, as Qwen2AudioProcessor counts."""
    positions = (frames - 1) // 2 + 1
    return positions, (positions - 2) // 2 + 1


def log_mel(samples: np.ndarray, spec: AudioSpec, filters: torch.Tensor) -> np.ndarray:
    """float32 [feature_size, n_samples // hop_length]: the clip zero-padded to the window."""
    padded = np.zeros(spec.n_samples, dtype=np.float32)
    padded[: len(samples)] = samples[: spec.n_samples]
    waveform = torch.from_numpy(padded)[None]  # transformers runs a batch of one
    stft = torch.stft(waveform, spec.n_fft, spec.hop_length, window=torch.hann_window(spec.n_fft),
                      return_complex=True)
    magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
    mel = filters.T @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0] - 8.0)
    return ((log_spec + 4.0) / 4.0)[0].numpy()


class AudioFeatures:
    """Turns decoded clips (mono float32 at spec.sampling_rate) into AudioInputs."""

    def __init__(self, spec: AudioSpec) -> None:
        self.spec = spec
        self.filters = torch.from_numpy(mel_filters(spec)).float()

    def __call__(self, samples: Any) -> AudioInput:
        """ValueError for a clip longer than the window or too short to give a token."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        spec = self.spec
        if len(samples) > spec.n_samples:
            raise ValueError(f"the audio is {len(samples) / spec.sampling_rate:.2f} s long; the model reads at most "
                             f"{spec.chunk_length} s")
        frames = -(-len(samples) // spec.hop_length)  # the feature mask: one frame per hop started
        positions, tokens = num_audio_tokens(frames)
        if tokens < 1:
            raise ValueError(f"the audio is {len(samples) / spec.sampling_rate * 1000:.0f} ms long, too short for one "
                             f"audio token (it needs more than {2 * spec.hop_length / spec.sampling_rate * 1000:g} ms)")
        features = np.ascontiguousarray(log_mel(samples, spec, self.filters)[:, : 2 * positions + 1])
        digest = hashlib.sha256(b"audio" + features.tobytes()).digest()
        return AudioInput(features, positions, tokens, digest)
