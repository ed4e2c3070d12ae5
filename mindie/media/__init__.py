"""Media in requests: fetch (local path under an allowed directory, data: URI, http/https with
limits) and decode (Pillow). Model-specific preprocessing lives with the model
(`mindie.model.qwen2_vl_processor`)."""

from mindie.media.fetch import MAX_IMAGE_BYTES, MediaError, MediaPolicy, decode_image, load_image

__all__ = ["MAX_IMAGE_BYTES", "MediaError", "MediaPolicy", "decode_image", "load_image"]
