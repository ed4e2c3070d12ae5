from __future__ import annotations

import torch

from mindie import ops
from mindie.ops.memory import _HugePageArena


def test_kv_caches_on_huge_pages_are_zeros_of_the_shape_and_their_own():
    """Every layer's key and value cache is zeros of the shape, cache-line aligned, writable and
    disjoint from the others (one region holds them all); a large region starts on a 2 MiB page."""
    cases = [(3, (3, 5), torch.float32), (2, (64, 16, 8, 64), torch.bfloat16), (5, (600, 16, 4, 128), torch.float32),
             (2, (1000, 7, 3, 25), torch.float32)]  # 2100000-byte caches: no multiple of 64, in one region
    for layers, shape, dtype in cases:
        caches = ops.kv_caches_on_huge_pages(layers, shape, dtype)
        assert len(caches) == layers
        flat = [t for pair in caches for t in pair]
        for t in flat:
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
            assert not t.any()
        if 2 * layers * flat[0].numel() * flat[0].element_size() >= 4 << 20:
            assert flat[0].data_ptr() % (2 << 20) == 0
        for i, t in enumerate(flat):
            t.fill_(i + 1)
        for i, t in enumerate(flat):  # no cache overlaps another
            assert bool((t == i + 1).all()), i


def test_arena_slices_are_aligned_and_disjoint():
    arena = _HugePageArena()
    sizes = [1, 63, 64, 4097, 3 << 20, 70 << 20, 5, 30 << 20, 40 << 20]  # one over a chunk; chunk boundaries crossed
    slices = [arena.take(n) for n in sizes]
    for i, (n, s) in enumerate(zip(sizes, slices)):
        assert s.numel() == n and s.data_ptr() % 64 == 0
        s.fill_(i + 1)
    for i, s in enumerate(slices):
        assert bool((s == i + 1).all()), i
