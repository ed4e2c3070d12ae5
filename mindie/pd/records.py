"""The `/dresult` record layer (MindIE's `WrapChunkedDResponse` / `DResChunkHandler`).

A D instance streams, on one long-lived `GET /dresult` response, records of the form
`reqId:<id>\\0<kind>:<body>\\0`; keep-alives are `ka:heartbeat\\0` with no reqId part. The
coordinator parses each HTTP chunk on its own, so a record must never be split across chunks:
`encode` returns whole records and the dispatcher writes each call's bytes as one chunk.

A body may itself end in `\\0` (a vLLM `/generate` stream event does); MindIE's parser treats a run
of `\\0` as one separator, so the decoder here keeps such a body's own trailing `\\0` by reading a
body up to the last `\\0` of a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum


class RecordKind(StrEnum):
    DATA = "data"  # one stream event, byte for byte as the single instance streams it
    LAST_DATA = "lastData"  # the last stream event, or a non-stream request's whole body
    ERROR = "error"  # terminal: plain text for the client
    RETRY = "retry"  # recompute: the request rebuilt in its family's body
    CLOSE = "close"  # this stream is superseded by a newer GET /dresult
    KEEP_ALIVE = "ka"


# The reqId MindIE puts on a close record, which belongs to no request.
CLOSE_REQ_ID = "0xffffffffffffffff"
CLOSE_TEXT = "new connection is to established, close the old one."
HEARTBEAT = b"ka:heartbeat\0"
# Ours, on the /dresult response: the decode process's own random id (a coordinator that re-links
# to another one knows its requests there are lost) and its kv_trans_timeout in seconds (how long
# the coordinator lets a lost link come back before failing the requests on it).
EPOCH_HEADER = "x-mindie-epoch"
KV_TIMEOUT_HEADER = "x-mindie-kv-trans-timeout"


@dataclass(frozen=True)
class Record:
    kind: RecordKind
    req_id: str | None  # None for keep-alives
    body: bytes


def encode(req_id: str, kind: RecordKind, body: bytes | str) -> bytes:
    if isinstance(body, str):
        body = body.encode()
    return b"reqId:" + req_id.encode() + b"\0" + kind.value.encode() + b":" + body + b"\0"


def close_record() -> bytes:
    return encode(CLOSE_REQ_ID, RecordKind.CLOSE, CLOSE_TEXT)


class RecordError(ValueError):
    pass


class RecordDecoder:
    """Splits a `/dresult` byte stream into records. It buffers a partial record across `feed`
    calls (our own D never splits one, but TCP reads need not follow HTTP chunks), and raises
    `RecordError` on a keyword it cannot place, naming it."""

    def __init__(self) -> None:
        self._buffer = b""
        self._req_id: str | None = None

    def feed(self, data: bytes) -> Iterator[Record]:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\0")
            if end < 0:
                return
            # A body's own trailing \0 belongs to it: consume the whole run, keep all but one. A
            # run cut by the end of the buffer is taken as it is: our D writes whole records per
            # chunk, so the end of what arrived is the end of a record.
            run_end = end
            while run_end + 1 < len(self._buffer) and self._buffer[run_end + 1] == 0:
                run_end += 1
            field, self._buffer = self._buffer[:run_end], self._buffer[run_end + 1:]
            if not field:
                continue
            key, sep, value = field.partition(b":")
            if not sep:
                raise RecordError(f"record field without a keyword: {field[:40]!r}")
            name = key.decode("ascii", "replace")
            if name == "reqId":
                self._req_id = value.decode()
                continue
            try:
                kind = RecordKind(name)
            except ValueError:
                raise RecordError(f"unknown record keyword {name!r}") from None
            if kind is RecordKind.KEEP_ALIVE:
                yield Record(kind, None, value)
                continue
            if self._req_id is None:
                raise RecordError(f"{name} record without a preceding reqId")
            yield Record(kind, self._req_id, value)
            self._req_id = None
