"""Media in requests: fetch (local path under an allowed directory, data: URI, http/https with
limits), decode images (Pillow) and probe videos (PyAV). Model-specific preprocessing lives with the
model (`mindie.model.qwen2_vl_processor`)."""

from mindie.media.fetch import MAX_IMAGE_BYTES, MAX_VIDEO_BYTES, MediaError, MediaPolicy, decode_image, load_image
from mindie.media.video import VideoClip, load_video, probe_video

__all__ = ["MAX_IMAGE_BYTES", "MAX_VIDEO_BYTES", "MediaError", "MediaPolicy", "VideoClip", "decode_image",
           "load_image", "load_video", "probe_video"]
