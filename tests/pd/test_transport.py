"""The KV transports on plain byte arenas: the fake one, and TCP over loopback (checksums, the
deadline against a stalled peer, refusals that name the reason)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from mindie.pd.tcp_transport import TCPTransport
from mindie.pd.transport import FakeTransport, KVArena, KVHandle, KVLayout, PullStatus, runs

LAYOUT = KVLayout("tiny", "float32", 2, 2, 8, 4, "safetensors")


def arena(num_blocks: int = 16, seed: int | None = None) -> KVArena:
    rng = np.random.default_rng(seed)
    make = (lambda: rng.integers(0, 256, (num_blocks, 4, 2, 8 * 4), dtype=np.uint8)) if seed is not None else (
        lambda: np.zeros((num_blocks, 4, 2, 8 * 4), dtype=np.uint8))
    return KVArena([(make(), make()) for _ in range(2)])


def same_blocks(a: KVArena, src: list[int], b: KVArena, dst: list[int]) -> bool:
    return all(np.array_equal(ta[s], tb[d]) for (ka, va), (kb, vb) in zip(a.layers, b.layers)
               for ta, tb in ((ka, kb), (va, vb)) for s, d in zip(src, dst))


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    assert runs([3, 4, 5, 9], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 1), (9, 8, 1)]
    with pytest.raises(ValueError, match="2 source blocks but 1"):
        runs([1, 2], [1])


def test_fake_transport_pulls_and_fails_on_request():
    registry: dict[str, FakeTransport] = {}
    p = FakeTransport(arena(seed=1), "p", registry)
    d = FakeTransport(arena(), "d", registry)
    handle = p.publish("7", [2, 3, 9])
    job = d.pull(handle, [5, 6, 7], time.monotonic() + 5)
    assert job.wait(5) is PullStatus.SUCCESS and same_blocks(p.arena, [2, 3, 9], d.arena, [5, 6, 7])
    assert p.release("7") and not p.release("7")
    assert d.pull(handle, [5, 6, 7], time.monotonic() + 5).wait(5) is PullStatus.FAIL_IRREVERSIBLE
    broken = FakeTransport(arena(), "x", registry, fail=PullStatus.FAIL_REVERSIBLE)
    assert broken.pull(p.publish("8", [1]), [1], time.monotonic() + 5).wait(5) is PullStatus.FAIL_REVERSIBLE


@pytest.fixture
def pair():
    p = TCPTransport(arena(seed=2), LAYOUT, "secret", "127.0.0.1", 0, timeout_s=5)
    d = TCPTransport(arena(), LAYOUT, "secret", "127.0.0.1", 0, timeout_s=5)
    yield p, d
    p.close()
    d.close()


def test_tcp_pull_copies_every_block(pair):
    p, d = pair
    handle = p.publish("42", [0, 1, 2, 7, 8])
    job = d.pull(handle, [10, 11, 3, 4, 5], time.monotonic() + 5)
    assert job.wait(5) is PullStatus.SUCCESS, job.error
    assert same_blocks(p.arena, [0, 1, 2, 7, 8], d.arena, [10, 11, 3, 4, 5])
    assert not np.any(d.arena.layers[0][0][[0, 1, 2, 6, 7, 8, 9]])  # nothing else written


def test_tcp_refusals_name_the_reason(pair):
    p, d = pair
    handle = p.publish("42", [0, 1])
    wrong_token = TCPTransport(arena(), LAYOUT, "guess", "127.0.0.1", 0, timeout_s=5)
    other_layout = TCPTransport(arena(), replace(LAYOUT, num_kv_heads=4), "secret", "127.0.0.1", 0, timeout_s=5)
    try:
        job = wrong_token.pull(handle, [0, 1], time.monotonic() + 5)
        assert job.wait(5) is PullStatus.FAIL_IRREVERSIBLE and "token" in job.error
        job = other_layout.pull(handle, [0, 1], time.monotonic() + 5)
        assert job.wait(5) is PullStatus.FAIL_IRREVERSIBLE and "num_kv_heads is 2 here but 4" in job.error
        job = d.pull(KVHandle("43", p.addr, [0, 1]), [0, 1], time.monotonic() + 5)
        assert job.wait(5) is PullStatus.FAIL_IRREVERSIBLE and "not published" in job.error
        p.release("42")
        job = d.pull(handle, [0, 1], time.monotonic() + 5)
        assert job.wait(5) is PullStatus.FAIL_IRREVERSIBLE and "released or expired" in job.error
    finally:
        wrong_token.close()
        other_layout.close()


def test_tcp_pull_stops_at_the_deadline_on_a_stalled_peer(pair):
    _, d = pair
    stalled = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(stalled.accept()[0]), daemon=True).start()
    try:
        start = time.monotonic()
        job = d.pull(KVHandle("1", f"127.0.0.1:{stalled.getsockname()[1]}", [0]), [0], start + 0.5)
        assert job.wait(5) is PullStatus.FAIL_REVERSIBLE and "deadline" in job.error
        assert time.monotonic() - start < 2
    finally:
        stalled.close()
        for s in accepted:
            s.close()


def test_layout_mismatch_names_the_field():
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.mismatch(replace(LAYOUT, block_size=16)) == \
        "KV layout mismatch: block_size is 4 here but 16 on the peer"


def test_tcp_pull_between_bf16_torch_caches():
    """The server's arena is a uint8 view of its torch cache: a pull lands bf16 values exactly."""
    import torch

    shape = (8, 4, 2, 8)
    src = [(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)) for _ in range(2)]
    dst = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)) for _ in range(2)]

    def view(caches):
        return KVArena([(k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()) for k, v in caches])

    layout = replace(LAYOUT, dtype="bfloat16")
    p = TCPTransport(view(src), layout, "secret", "127.0.0.1", 0, timeout_s=5)
    d = TCPTransport(view(dst), layout, "secret", "127.0.0.1", 0, timeout_s=5)
    try:
        job = d.pull(p.publish("1", [1, 2, 5]), [0, 6, 7], time.monotonic() + 5)
        assert job.wait(5) is PullStatus.SUCCESS, job.error
        for (sk, sv), (dk, dv) in zip(src, dst):
            assert torch.equal(dk[[0, 6, 7]], sk[[1, 2, 5]]) and torch.equal(dv[[0, 6, 7]], sv[[1, 2, 5]])
            assert not dk[[1, 2, 3, 4, 5]].any()
    finally:
        p.close()
        d.close()
