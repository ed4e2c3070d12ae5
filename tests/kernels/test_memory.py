from __future__ import annotations

import torch

from mindie import ops
from mindie.ops.memory import _HugePageArena


def test_zeros_on_huge_pages_are_zeros_of_the_shape():
    cases = [((3, 5), torch.float32), ((64, 16, 8, 64), torch.bfloat16), ((600, 16, 4, 128), torch.float32)]
    for shape, dtype in cases:
        t = ops.zeros_on_huge_pages(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        if t.numel() * t.element_size() >= 4 << 20:
            assert t.data_ptr() % (2 << 20) == 0
        t.fill_(1)  # writable, and every element is its own
        assert int(t.sum()) == t.numel()


def test_arena_slices_are_aligned_and_disjoint():
    arena = _HugePageArena()
    sizes = [1, 63, 64, 4097, 3 << 20, 70 << 20, 5, 30 << 20, 40 << 20]  # one over a chunk; chunk boundaries crossed
    slices = [arena.take(n) for n in sizes]
    for i, (n, s) in enumerate(zip(sizes, slices)):
        assert s.numel() == n and s.data_ptr() % 64 == 0
        s.fill_(i + 1)
    for i, s in enumerate(slices):
        assert bool((s == i + 1).all()), i
