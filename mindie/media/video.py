"""Videos in requests: fetched as every medium is (mindie.media.fetch), probed and decoded with PyAV.

A fetched video is probed once (container, first video stream, frame count, frame rate, size): the
model's preprocessing then picks which frames it reads from those facts, and only those frames are
decoded into pixels (a minute of 30 fps video is 1800 frames; a sampler at 2 fps keeps 120).
Containers: MP4 (and its MOV family), AVI and ASF (WMV), as seed 004 lists them.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from mindie.media.fetch import VIDEO, MediaError, MediaPolicy, fetch_media

# FFmpeg's demuxer names for the containers the seeds allow: mp4 (FFmpeg groups it with mov), avi, wmv.
VIDEO_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "avi": "avi", "asf": "wmv"}
MAX_FRAME_PIXELS = 8192 * 8192  # a decoded frame; a small file can declare a huge canvas
MAX_FRAMES = 100_000  # frames a clip may hold (about an hour at 30 fps): counting them is a pass over the file


@dataclass(frozen=True)
class VideoClip:
    """A probed video: its encoded bytes and what the frame sampler needs to know of it."""

    data: bytes
    container: str  # mp4 | avi | wmv
    total_frames: int
    fps: float
    width: int
    height: int

    def frames(self, indices: list[int]) -> np.ndarray:
        """Frames `indices` (ascending, each < total_frames; repeats allowed), decoded to RGB:
        uint8 [len(indices), height, width, 3]. MediaError if the stream ends or breaks early."""
        import av

        wanted = set(indices)
        last = max(indices)
        got: dict[int, np.ndarray] = {}
        try:
            with av.open(io.BytesIO(self.data)) as container:
                stream = container.streams.video[0]
                for i, frame in enumerate(container.decode(stream)):
                    if i in wanted:
                        got[i] = frame.to_ndarray(format="rgb24")
                    if i >= last:
                        break
        except av.error.FFmpegError as exc:
            raise MediaError(f"the {self.container} video's data is damaged ({exc})") from None
        if len(got) < len(wanted):
            raise MediaError(f"the {self.container} video ends after {len(got)} of the {len(wanted)} frames read")
        if any(f.shape != (self.height, self.width, 3) for f in got.values()):
            raise MediaError(f"the {self.container} video changes its frame size midway; one size is read")
        return np.stack([got[i] for i in indices])


async def load_video(ref: str, policy: MediaPolicy, where: str) -> VideoClip:
    """The video `ref` names, probed (no frame decoded yet). MediaError on any refusal."""
    data = await fetch_media(ref, policy, where, VIDEO)
    return await asyncio.to_thread(probe_video, data, where)


def probe_video(data: bytes, where: str) -> VideoClip:
    """The container and first video stream of `data`, its frames counted by demuxing (no decoding)."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            container_name = VIDEO_CONTAINERS.get(container.format.name)
            if container_name is None:
                raise MediaError(f"{where} is a {container.format.name} file; the video formats read are mp4, avi "
                                 "and wmv")
            if not container.streams.video:
                raise MediaError(f"{where} holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate or Fraction(0)
            total = 0
            for packet in container.demux(stream):
                total += packet.size > 0  # the flush packet at the end carries no frame
                if total > MAX_FRAMES:
                    raise MediaError(f"{where} has more than {MAX_FRAMES} frames; the limit is {MAX_FRAMES}")
    except av.error.FFmpegError as exc:
        raise MediaError(f"{where} is not a readable video ({type(exc).__name__}); send mp4, avi or wmv") from None
    if total == 0 or width <= 0 or height <= 0:
        raise MediaError(f"{where} holds no video frames")
    if width * height > MAX_FRAME_PIXELS:
        raise MediaError(f"{where} is {width}x{height} pixels a frame; the limit is {MAX_FRAME_PIXELS} pixels")
    if rate <= 0:
        raise MediaError(f"{where} declares no frame rate; the frame sampler needs one")
    return VideoClip(data, container_name, total, float(rate), width, height)
