"""Time per call of the token-bitmask kernel (grammar-constrained decoding) on every ISA variant,
against the plain-PyTorch reference and llguidance's own torch formulation (unpack + masked_fill).

    python -P benchmarks/bench_token_mask.py [--rows 16] [--vocab 49152] [--density 0.02]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]

from common import bench  # noqa: E402
from reference.token_mask import apply_token_bitmask as ref_apply  # noqa: E402
from reference.token_mask import unpack_bitmask  # noqa: E402

from mindie import _C, ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--density", type=float, default=0.02, help="fraction of allowed tokens")
    args = parser.parse_args()
    rows, vocab = args.rows, args.vocab
    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bits = (torch.rand(rows, words, 32, generator=gen) < args.density).to(torch.int64)
    packed = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    base = torch.randn(rows, vocab, generator=gen)
    logits = base.clone()
    every_row = torch.arange(rows, dtype=torch.int32)
    half = torch.where(every_row % 2 == 0, every_row, -1).to(torch.int32)  # half the batch constrained
    print(f"kernel threads={_C.get_num_threads()} rows={rows} vocab={vocab} allowed density={args.density}")

    def kernel(index: torch.Tensor) -> float:
        # The kernel's work does not depend on the logits' values, so repeating it in place is fair.
        return bench(lambda: ops.apply_token_bitmask(logits, bitmask, index))

    previous = _C.get_isa()
    for isa in _C.available_isas():
        _C.set_isa(isa)
        print(f"{isa:8s} all rows constrained  {kernel(every_row) * 1e6:9.1f} us")
        print(f"{isa:8s} half constrained      {kernel(half) * 1e6:9.1f} us")
    _C.set_isa(previous)
    allowed = unpack_bitmask(bitmask, vocab)
    torch_us = bench(lambda: base.masked_fill(~allowed, float("-inf"))) * 1e6
    unpack_us = bench(lambda: base.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))) * 1e6
    ref_us = bench(lambda: ref_apply(base, bitmask, every_row), min_time=0.2) * 1e6
    print(f"torch masked_fill, mask pre-unpacked {torch_us:9.1f} us")
    print(f"torch unpack + masked_fill           {unpack_us:9.1f} us")
    print(f"reference (tests/reference)          {ref_us:9.1f} us")


if __name__ == "__main__":
    main()
