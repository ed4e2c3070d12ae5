"""Memory the kernels stream: weights and the KV cache on transparent huge pages.

A decode step reads every weight and the whole KV cache of its sequences once; on 4 KiB pages each
4 KiB costs a TLB walk and a hardware-prefetch restart (one Sapphire Rapids core read Q4_0 panels at
11.5 GB/s there against 16 on huge pages)."""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def return_free_heap() -> None:
    """Hands the free pages of the C heap back to the OS (glibc's malloc_trim), where there is one:
    what loading a model allocated and freed otherwise stays resident until the heap reuses it (10
    MiB of the embedded model's start-up). A no-op elsewhere."""
    if sys.platform != "linux":
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def _advised_chunk(n: int) -> torch.Tensor:
    """An uninitialised uint8 [n] (n a multiple of 2 MiB) starting on a 2 MiB boundary, advised as
    transparent huge pages (Linux, THP in madvise mode) before anything touches it. Best effort:
    where the advice fails the memory is ordinary."""
    buf = torch.empty(n + _HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % _HUGE_PAGE
    if _madvise is not None:
        _madvise(buf.data_ptr() + start, n, _MADV_HUGEPAGE)
    return buf[start:start + n]


class _HugePageArena:
    """Packed weights carved one after another out of chunks on transparent huge pages: shared
    chunks rather than each matrix on its own pages because most are smaller than two huge pages
    (a 1.7B model's q/k/v/o, every MoE expert), and rounding each up would waste up to 2 MiB a
    matrix. Untouched chunk tails are never resident; a chunk is freed once the arena has moved on
    and no weight in it is alive."""

    _CHUNK = 64 << 20
    _ALIGN = 64  # the kernels' vector loads want cache-line-aligned panels

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        """An uninitialised uint8 [n] on huge pages where the OS gives them."""
        with self._lock:
            if self._chunk is None or self._used + n > self._chunk.numel():
                self._chunk = _advised_chunk(max(self._CHUNK, -(-n // _HUGE_PAGE) * _HUGE_PAGE))
                self._used = 0
            out = self._chunk[self._used:self._used + n]
            self._used = -(-(self._used + n) // self._ALIGN) * self._ALIGN
            return out


weight_arena = _HugePageArena()


def kv_caches_on_huge_pages(num_layers: int, shape: tuple[int, ...],
                            dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (key, value) cache, zeros of `shape`, one after another in one region whose whole
    2 MiB pages are advised as transparent huge pages (written once at start, then read by every
    decode step). One region rather than one per cache: zeroing a cache on pages of its own made its
    last page resident whole, 1.9 MiB of each of the embedded model's 60 caches (112 MiB of 2 GiB)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = torch.Size(shape).numel() * elem
    slot = -(-n // 64) * 64  # each cache on a cache line, for the kernels' vector loads
    total = 2 * num_layers * slot
    if total < 2 * _HUGE_PAGE:
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
    region = _advised_chunk(-(-total // _HUGE_PAGE) * _HUGE_PAGE)[:total]
    region.zero_()

    def cache(i: int) -> torch.Tensor:
        return region[i * slot:i * slot + n].view(dtype).view(shape)

    return [(cache(2 * layer), cache(2 * layer + 1)) for layer in range(num_layers)]
