"""Audio in requests: fetched as every medium is (mindie.media.fetch), decoded with PyAV to mono
float32 at the rate the model's feature extractor reads (PyAV's AudioResampler downmixes and
resamples). Formats: WAV, MP3 and FLAC, as seed 004 lists them.

Decoding stops as soon as the audio is longer than the caller's limit (an audio model's window),
so a 20 MB file of hours of low-bitrate MP3 is refused after reading just past the limit, never
decoded whole.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass

import numpy as np

from mindie.media.fetch import AUDIO, MediaError, MediaPolicy, fetch_media

# FFmpeg's demuxer names for the formats the seeds allow
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac"}


@dataclass(frozen=True)
class Audio:
    """Decoded audio: mono float32 samples at `sampling_rate`."""

    samples: np.ndarray  # float32 [n]
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sampling_rate


async def load_audio(ref: str, policy: MediaPolicy, where: str, sampling_rate: int, max_seconds: float) -> Audio:
    """The audio `ref` names, decoded at `sampling_rate`. MediaError on any refusal."""
    data = await fetch_media(ref, policy, where, AUDIO)
    return await asyncio.to_thread(decode_audio, data, where, sampling_rate, max_seconds)


def decode_audio(data: bytes, where: str, sampling_rate: int, max_seconds: float) -> Audio:
    """`data` (a WAV, MP3 or FLAC file) as mono float32 at `sampling_rate`; MediaError for another
    format, damaged data, no audio stream, or audio longer than `max_seconds`."""
    import av

    limit = int(max_seconds * sampling_rate)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data)) as container:
            if container.format.name not in AUDIO_FORMATS:
                raise MediaError(f"{where} is a {container.format.name} file; the audio formats read are wav, mp3 "
                                 "and flac")
            if not container.streams.audio:
                raise MediaError(f"{where} holds no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            frames = container.decode(container.streams.audio[0])
            for frame in [*frames, None]:  # None flushes the resampler's tail
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > limit:
                        raise MediaError(f"{where} is longer than {max_seconds:g} s, the served model's audio "
                                         "window; send a shorter clip")
    except av.error.FFmpegError as exc:
        raise MediaError(f"{where} is not readable audio ({type(exc).__name__}); send wav, mp3 or flac") from None
    if total == 0:
        raise MediaError(f"{where} holds no audio samples")
    return Audio(np.concatenate(chunks).astype(np.float32, copy=False), sampling_rate)


def resample(samples: np.ndarray, rate: int, sampling_rate: int) -> Audio:
    """Mono samples (any float or int dtype PyAV reads as float) at `rate` as float32 at
    `sampling_rate` (vLLM's offline (array, rate) audio input); unchanged when the rates agree."""
    import av

    samples = np.asarray(samples, dtype=np.float32).reshape(-1)
    if rate == sampling_rate:
        return Audio(samples, sampling_rate)
    frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame) + resampler.resample(None)]
    return Audio(np.concatenate(out) if out else np.zeros(0, np.float32), sampling_rate)
