"""mindie.media's fetch rules, each refusal with its exact message: local paths (only under the
allowed directory), data: URIs, http(s) from a local server (size cap that stops reading,
redirect limit, loopback refused unless allowed, HTTP errors), formats."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import pytest
from helpers.media_server import MediaServer
from helpers.tiny_vl import draw

from mindie.media import MediaError, MediaPolicy, load_image


def encoded(image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


PNG = encoded(draw(64, 48, 1), "PNG")
JPEG = encoded(draw(64, 48, 2), "JPEG")
GIF = encoded(draw(64, 48, 3), "GIF")


@pytest.fixture(scope="module")
def media_server():
    server = MediaServer({"image.png": PNG, "image.jpg": JPEG, "image.gif": GIF, "junk.png": b"not an image"})
    yield server
    server.close()


LOOPBACK_ALLOWED = MediaPolicy(allow_private_urls=True)  # the tests' URLs are served on 127.0.0.1


def load(ref: str, policy: MediaPolicy = LOOPBACK_ALLOWED):
    return asyncio.run(load_image(ref, policy, "part"))


def refused(ref: str, policy: MediaPolicy = LOOPBACK_ALLOWED) -> str:
    with pytest.raises(MediaError) as info:
        load(ref, policy)
    return str(info.value)


def test_data_uris():
    image = load("data:image/png;base64," + base64.b64encode(PNG).decode())
    assert (image.format, image.size) == ("PNG", (64, 48))
    assert load("data:image/jpeg;base64," + base64.b64encode(JPEG).decode()).format == "JPEG"
    assert refused("data:image/png," + "abc") == ("part: a data: URI must be "
                                                  "data:<image/jpeg|image/jpg|image/png>;base64,<data>")
    assert refused("data:text/plain;base64,QUJD") == ("part: data: URI type 'text/plain' is not one of image/jpeg, "
                                                      "image/jpg, image/png")
    assert refused("data:image/png;base64,@@@@") == "part: the data: URI's payload is not valid base64"
    big = "data:image/png;base64," + "A" * (28 * 2**20)
    assert refused(big) == "part is about 21.0 MB; the limit is 20 MB for images"


def test_formats():
    gif = "data:image/png;base64," + base64.b64encode(GIF).decode()
    assert refused(gif) == "part is a GIF image; the formats read are jpg, jpeg and png"
    junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    assert refused(junk) == "part is not a readable image (UnidentifiedImageError); send jpg, jpeg or png"
    png = encoded(draw(400, 300, 5), "PNG")
    truncated = "data:image/png;base64," + base64.b64encode(png[: len(png) * 3 // 4]).decode()
    assert refused(truncated) == "part: the png data is damaged (image file is truncated)"


def test_local_paths(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (outside / "b.png").write_bytes(PNG)
    os.symlink(outside / "b.png", allowed / "link.png")
    policy = MediaPolicy(allowed_local_path=str(allowed))
    assert load(str(allowed / "a.png"), policy).size == (64, 48)
    assert load("file://" + str(allowed / "a.png"), policy).size == (64, 48)
    assert refused(str(allowed / "a.png"), MediaPolicy()) == (
        "part: local paths are refused; the server reads local media only under a directory named by "
        "--allowed-local-media-path")
    for path in (outside / "b.png", allowed / "link.png", allowed / ".." / "outside" / "b.png"):
        assert refused(str(path), policy) == (f"part: {str(path)!r} is not under the allowed media directory "
                                              f"{str(allowed)!r} (an absolute path is required; links are "
                                              "followed before the check)")
    assert refused("a.png", policy).startswith("part: 'a.png' is not under the allowed media directory")
    assert refused(str(allowed / "none.png"), policy) == f"part: {str(allowed / 'none.png')!r} is not a file"
    with open(allowed / "huge.png", "wb") as f:
        f.truncate(21 * 2**20)  # sparse: the size is refused before anything is read
    assert refused(str(allowed / "huge.png"), policy) == "part is 21.0 MB; the limit is 20 MB for images"


def test_urls(media_server):
    url = media_server.url
    assert load(f"{url}/image.png").size == (64, 48)
    assert load(f"{url}/image.jpg").format == "JPEG"
    assert load(f"{url}/redirect/3").format == "PNG"
    assert refused(f"{url}/redirect/4") == "part: more than 3 redirects"
    assert refused(f"{url}/missing") == f"part: fetching '{url}/missing' answered HTTP 404"
    assert refused(f"{url}/image.gif") == "part is a GIF image; the formats read are jpg, jpeg and png"
    assert refused(f"{url}/big-declared") == "part is 21.0 MB (Content-Length); the limit is 20 MB for images"
    assert refused(f"{url}/big") == ("part is larger than that (reading stopped at the limit); "
                                     "the limit is 20 MB for images")
    assert refused("ftp://example.com/a.png") == ("part: scheme 'ftp' is not supported; use a local path, a data: "
                                                  "URI, http or https")


def test_loopback_and_link_local_hosts_are_refused_unless_allowed(media_server):
    port = media_server.url.rsplit(":", 1)[1]
    for host, ip in (("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"), ("169.254.169.254", "169.254.169.254"),
                     ("[::1]", "::1"), ("[::ffff:127.0.0.1]", "127.0.0.1")):
        message = refused(f"http://{host}:{port}/image.png", MediaPolicy())
        assert message == (f"part: {host.strip('[]')!r} resolves to {ip}, a loopback or link-local address; such "
                           "URLs are refused unless the server runs with --allow-private-media-urls")
    # a redirect is checked again at each hop
    assert load(f"{media_server.url}/redirect/1").format == "PNG"
