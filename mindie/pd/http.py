"""The one HTTP client call P and D make to each other: a JSON POST on the peer's interCommPort,
HTTP/1.1 with `Connection: close`, bounded by a deadline. Small enough to own rather than add a
client library to the server's dependencies."""

from __future__ import annotations

import asyncio
import json
from typing import Any

TOKEN_HEADER = "x-mindie-intercomm-token"
MAX_REPLY = 2**20


class PeerError(Exception):
    """The peer could not be reached, or answered something that is not an HTTP JSON reply. The
    message names no address: it may reach a client (P's "Send D request failed:<why>")."""


async def post_json(host: str, port: int, path: str, body: dict[str, Any], token: str,
                    timeout_s: float, local_host: str) -> tuple[int, Any]:
    """(status, parsed JSON body or None); PeerError on a connection failure or timeout. The call
    leaves from local_host, the caller's own serving address: the peer checks the caller against
    its peer list, and on 127.0.0.x the kernel would otherwise pick 127.0.0.1."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{TOKEN_HEADER}: {token}\r\nConnection: close\r\n\r\n").encode()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, local_addr=(local_host, 0))
            try:
                writer.write(head + data)
                await writer.drain()
                status_line = await reader.readline()
                parts = status_line.split(b" ", 2)
                if len(parts) < 2 or not parts[1].isdigit():
                    raise PeerError("the peer's reply is not HTTP")
                length = None
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                if length is not None and length > MAX_REPLY:
                    raise PeerError(f"the peer's reply of {length} bytes is too large")
                raw = await (reader.readexactly(length) if length is not None else reader.read(MAX_REPLY))
            finally:
                writer.close()
    except TimeoutError:
        raise PeerError(f"no reply within {timeout_s:g} s") from None
    except ConnectionRefusedError:
        raise PeerError("connection refused") from None
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        raise PeerError(f"connection failed ({type(exc).__name__})") from None
    try:
        return int(parts[1]), json.loads(raw) if raw else None
    except json.JSONDecodeError:
        raise PeerError("the peer's reply is not JSON") from None
