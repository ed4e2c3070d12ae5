"""Fetch one image, video or audio clip a request names (a local path under the directory the operator
allows, a base64 `data:` URI, or an http/https URL) and decode images.

Every refusal is a `MediaError` whose message names the part (`where`) and the rule it broke; the
server answers it as a 400. Limits: the kind's encoded bytes (20 MB for an image or an audio clip,
512 MB for a video; a download stops reading there), a timeout per URL, at most `max_redirects` redirects, each
hop's host checked again; URLs whose host resolves to a loopback, link-local or unspecified address
are refused unless the operator allows them (the server's own ports and cloud metadata services live
there). Image formats: JPEG and PNG; videos are probed in mindie.media.video, audio decoded in
mindie.media.audio.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

MAX_IMAGE_BYTES = 20 * 2**20  # seeds 000 / 004: images of at most 20 MB
MAX_VIDEO_BYTES = 512 * 2**20  # seed 004: videos of at most 512 MB
MAX_AUDIO_BYTES = 20 * 2**20  # seed 004: audio of at most 20 MB
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded size; a small file can declare a huge canvas
IMAGE_FORMATS = {"JPEG": "jpeg", "PNG": "png"}
_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class MediaError(ValueError):
    """A media part the server will not read; the message names the part and the rule."""


@dataclass(frozen=True)
class MediaKind:
    """What a fetch of one kind of media allows: its size limit and its data: URI types."""

    name: str
    max_bytes: int
    data_mimes: tuple[str, ...]
    plural: str = ""  # as the size refusal names the kind; "" for name + "s"


IMAGE = MediaKind("image", MAX_IMAGE_BYTES, ("image/jpeg", "image/jpg", "image/png"))
VIDEO = MediaKind("video", MAX_VIDEO_BYTES, ("video/mp4", "video/avi", "video/x-msvideo", "video/x-ms-wmv"))
AUDIO = MediaKind("audio", MAX_AUDIO_BYTES, ("audio/wav", "audio/x-wav", "audio/wave", "audio/mpeg", "audio/mp3",
                                             "audio/flac", "audio/x-flac"), "audio clips")


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows (`--allowed-local-media-path`, `--allow-private-media-urls`)."""

    allowed_local_path: str | None = None  # None: no local path is read
    allow_private_urls: bool = False  # loopback / link-local URL hosts
    timeout_s: float = 10.0
    max_redirects: int = 3


async def load_image(ref: str, policy: MediaPolicy, where: str) -> Any:
    """The image `ref` names, decoded (a Pillow image, pixels loaded). MediaError on any refusal."""
    data = await fetch_media(ref, policy, where, IMAGE)
    return await asyncio.to_thread(decode_image, data, where)  # decoding 20 MB takes a while: off the loop


async def fetch_media(ref: str, policy: MediaPolicy, where: str, kind: MediaKind) -> bytes:
    """The encoded bytes `ref` names, at most kind.max_bytes. MediaError on any refusal."""
    if not isinstance(ref, str) or not ref:
        raise MediaError(f"{where} must be a non-empty string: a local path, a data: URI or an http(s) URL")
    scheme = urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        return _from_data_uri(ref, kind, where)
    if scheme in ("http", "https"):
        try:
            async with asyncio.timeout(policy.timeout_s):  # the whole fetch, redirects included
                return await _from_url(ref, policy, kind, where)
        except TimeoutError:
            raise MediaError(f"{where}: fetching {ref!r} took longer than {policy.timeout_s:g} s") from None
    if scheme in ("", "file"):
        return await asyncio.to_thread(_from_local, ref.removeprefix("file://"), policy, kind, where)
    raise MediaError(f"{where}: scheme {scheme!r} is not supported; use a local path, a data: URI, http or https")


def decode_image(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # Pillow raises many types for bad input; all of them are the client's
        raise MediaError(f"{where} is not a readable image ({type(exc).__name__}); send jpg, jpeg or png") from None
    if image.format not in IMAGE_FORMATS:
        raise MediaError(f"{where} is a {image.format} image; the formats read are jpg, jpeg and png")
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise MediaError(f"{where} is {image.width}x{image.height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()
    except Exception as exc:
        raise MediaError(f"{where}: the {IMAGE_FORMATS[image.format]} data is damaged ({exc})") from None
    return image


def _too_big(where: str, kind: MediaKind, size: str) -> MediaError:
    plural = kind.plural or kind.name + "s"
    return MediaError(f"{where} is {size}; the limit is {kind.max_bytes // 2**20} MB for {plural}")


def _from_data_uri(ref: str, kind: MediaKind, where: str) -> bytes:
    m = _DATA_URI.match(ref)
    if m is None or not m["b64"]:
        raise MediaError(f"{where}: a data: URI must be data:<{'|'.join(kind.data_mimes)}>;base64,<data>")
    if (m["mime"] or "").lower() not in kind.data_mimes:
        raise MediaError(f"{where}: data: URI type {m['mime']!r} is not one of {', '.join(kind.data_mimes)}")
    payload = ref[m.end():]
    if len(payload) // 4 * 3 > kind.max_bytes + 3:  # judged before decoding
        raise _too_big(where, kind, f"about {len(payload) // 4 * 3 / 2**20:.1f} MB")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the data: URI's payload is not valid base64") from None
    if len(data) > kind.max_bytes:
        raise _too_big(where, kind, f"{len(data) / 2**20:.1f} MB")
    return data


def _from_local(path: str, policy: MediaPolicy, kind: MediaKind, where: str) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError(f"{where}: local paths are refused; the server reads local media only under a directory "
                         "named by --allowed-local-media-path")
    root = os.path.realpath(policy.allowed_local_path)
    real = os.path.realpath(path)
    if not os.path.isabs(path) or os.path.commonpath([root, real]) != root:
        raise MediaError(f"{where}: {path!r} is not under the allowed media directory {policy.allowed_local_path!r} "
                         "(an absolute path is required; links are followed before the check)")
    if not os.path.isfile(real):
        raise MediaError(f"{where}: {path!r} is not a file")
    size = os.path.getsize(real)
    if size > kind.max_bytes:
        raise _too_big(where, kind, f"{size / 2**20:.1f} MB")
    with open(real, "rb") as f:
        data = f.read(kind.max_bytes + 1)
    if len(data) > kind.max_bytes:  # grew since it was measured
        raise _too_big(where, kind, "larger than that")
    return data


async def _check_host(url: str, policy: MediaPolicy, where: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError(f"{where}: {url!r} is not an http or https URL with a host")
    if policy.allow_private_urls:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"{where}: the host {parts.hostname!r} does not resolve") from None
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
            ip = ip.ipv4_mapped
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
            raise MediaError(f"{where}: {parts.hostname!r} resolves to {ip}, a loopback or link-local address; "
                             "such URLs are refused unless the server runs with --allow-private-media-urls")


async def _from_url(url: str, policy: MediaPolicy, kind: MediaKind, where: str) -> bytes:
    """GET with redirects followed by hand, so that each hop's host is checked. The check resolves
    the name once and the connection resolves it again: a DNS server that answers differently the
    second time could still steer a fetch to a refused address (pinning the address is not built)."""
    import httpx

    async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            await _check_host(url, policy, where)
            try:
                async with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"{where}: fetching {url!r} answered HTTP {response.status_code}")
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > kind.max_bytes:
                        raise _too_big(where, kind, f"{int(declared) / 2**20:.1f} MB (Content-Length)")
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > kind.max_bytes:  # stop reading at the limit
                            raise _too_big(where, kind, "larger than that (reading stopped at the limit)")
                    return bytes(body)
            except httpx.TimeoutException:
                raise MediaError(f"{where}: fetching {url!r} took longer than {policy.timeout_s:g} s") from None
            except httpx.HTTPError as exc:
                raise MediaError(f"{where}: fetching {url!r} failed ({type(exc).__name__})") from None
    raise MediaError(f"{where}: more than {policy.max_redirects} redirects")
