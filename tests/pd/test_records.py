import pytest

from mindie.pd.records import (
    CLOSE_REQ_ID,
    HEARTBEAT,
    Record,
    RecordDecoder,
    RecordError,
    RecordKind,
    close_record,
    encode,
)


def test_encode_matches_mindie_layout():
    assert encode("1234567", RecordKind.DATA, "data: {}\n\n") == b"reqId:1234567\0data:data: {}\n\n\0"
    assert encode("7", RecordKind.LAST_DATA, b"{}") == b"reqId:7\0lastData:{}\0"
    assert close_record().startswith(b"reqId:" + CLOSE_REQ_ID.encode() + b"\0close:")


def test_several_records_per_chunk_and_keepalive():
    chunk = encode("1", RecordKind.DATA, "a") + HEARTBEAT + encode("2", RecordKind.ERROR, "boom")
    got = list(RecordDecoder().feed(chunk))
    assert got == [Record(RecordKind.DATA, "1", b"a"), Record(RecordKind.KEEP_ALIVE, None, b"heartbeat"),
                   Record(RecordKind.ERROR, "2", b"boom")]


def test_vllm_event_keeps_its_own_nul():
    body = b'{"text":["hi"]}\0'
    chunk = encode("9", RecordKind.DATA, body) + encode("9", RecordKind.LAST_DATA, body)
    got = list(RecordDecoder().feed(chunk))
    assert [r.body for r in got] == [body, body]


def test_partial_record_is_buffered_across_feeds():
    data = encode("5", RecordKind.RETRY, '{"inputs":"2,1,2"}')
    dec = RecordDecoder()
    out = []
    for i in range(len(data)):
        out += list(dec.feed(data[i:i + 1]))
    assert out == [Record(RecordKind.RETRY, "5", b'{"inputs":"2,1,2"}')]


@pytest.mark.parametrize("bad", [b"nokeyword\0", b"reqId:1\0bogus:x\0", b"data:x\0"])
def test_malformed_records_raise(bad):
    with pytest.raises(RecordError):
        list(RecordDecoder().feed(bad))
