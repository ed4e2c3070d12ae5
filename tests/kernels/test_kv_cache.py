from __future__ import annotations

import pytest
import torch
from reference.kv_cache import copy_blocks as ref_copy_blocks
from reference.kv_cache import reshape_and_cache as ref_reshape_and_cache

from mindie import ops

PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("src_dtype,cache_dtype", PAIRS)
@pytest.mark.parametrize("block_size,kv_heads,head_dim", [(1, 1, 8), (16, 3, 64), (5, 2, 17), (128, 1, 33)])
@pytest.mark.parametrize("num_tokens", [0, 1, 19])
def test_reshape_and_cache(isa, src_dtype, cache_dtype, block_size, kv_heads, head_dim, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens + block_size)
    num_blocks = 6 + num_tokens // block_size
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    # Keys as a strided slice of a fused projection output, like a model's qkv split.
    fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1  # padding token: skipped
    exp_k, exp_v = key_cache.clone(), value_cache.clone()
    ref_reshape_and_cache(key, value, exp_k, exp_v, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, exp_k) and torch.equal(value_cache, exp_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_within_and_across_pools(isa, dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(8, 4, 2, 16, generator=gen).to(dtype)
    expected = cache.clone()
    mapping = torch.tensor([[0, 5], [2, 6], [2, 7], [3, 3]])
    ref_copy_blocks(expected, expected, mapping)
    ops.copy_blocks(cache, cache, mapping)
    assert torch.equal(cache, expected)
    host = torch.zeros(3, 4, 2, 16, dtype=dtype)  # export to a separate pool and back
    ops.copy_blocks(cache, host, torch.tensor([[1, 0], [4, 2]]))
    assert torch.equal(host[0], cache[1]) and torch.equal(host[2], cache[4])
    fresh = torch.zeros_like(cache)
    ops.copy_blocks(host, fresh, torch.tensor([[2, 7]]))
    assert torch.equal(fresh[7], cache[4]) and torch.count_nonzero(fresh[:7]) == 0


def test_bad_arguments_raise():
    kc = torch.zeros(4, 8, 2, 16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 16)
    slots = torch.tensor([0, 1, 2])
    cases = [
        (dict(slot_mapping=torch.tensor([0, 1, 32])), "out of range"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), "int64"),
        (dict(slot_mapping=torch.tensor([0, 1])), "num_tokens"),
        (dict(key=torch.randn(3, 2, 8)), "head_dim"),
        (dict(key=torch.randn(3, 16, 2).transpose(1, 2)), "contiguous"),
        (dict(value=torch.randn(4, 2, 16)), "must match key"),
        (dict(key_cache=kc.bfloat16(), value_cache=vc.bfloat16(), key=k.bfloat16(), value=k.bfloat16()[:, :]), None),
        (dict(key_cache=kc, value_cache=vc, key=k.bfloat16(), value=k.bfloat16()), "cannot be written"),
        (dict(value_cache=torch.zeros(4, 8, 2, 8)), "must match key_cache"),
        (dict(key=k.double(), value=k.double()), "float32 or bfloat16"),
    ]
    for change, message in cases:
        args = dict(key=k, value=k, key_cache=kc, value_cache=vc, slot_mapping=slots) | change
        if message is None:
            ops.reshape_and_cache(**args)  # a valid variant must pass
            continue
        with pytest.raises((ValueError, TypeError), match=message):
            ops.reshape_and_cache(**args)
    for mapping, message in [
        (torch.tensor([[0, 4]]), "out of range"),
        (torch.tensor([[-1, 2]]), "out of range"),
        (torch.tensor([[0, 2], [1, 2]]), "twice"),
        (torch.tensor([[0, 1], [1, 2]]), "both a source and a destination"),
        (torch.tensor([0, 1]), "dimensions"),
    ]:
        with pytest.raises(ValueError, match=message):
            ops.copy_blocks(kc, kc, mapping)
    with pytest.raises(ValueError, match="block shape"):
        ops.copy_blocks(kc, torch.zeros(4, 8, 2, 8), torch.tensor([[0, 1]]))


def test_numpy_arrays_cross_through_dlpack():
    import numpy as np

    from mindie import _C

    key_cache = np.zeros((2, 4, 1, 8), dtype=np.float32)
    value_cache = np.zeros_like(key_cache)
    key = np.arange(16, dtype=np.float32).reshape(2, 1, 8)
    _C.reshape_and_cache(key, key + 1, key_cache, value_cache, np.array([5, 0], dtype=np.int64))
    assert (key_cache[1, 1, 0] == key[0, 0]).all() and (value_cache[0, 0, 0] == key[1, 0] + 1).all()
