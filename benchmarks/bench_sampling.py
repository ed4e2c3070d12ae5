"""Time per call of the sampling and beam-search kernels against the plain-PyTorch references
(tests/reference; per-row loops written for clarity, not speed).

    python -P benchmarks/bench_sampling.py [--rows 32] [--vocab 49152] [--repeat 50] [--isa avx512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference.beam_search import BeamHypotheses  # noqa: E402
from reference.beam_search import beam_search_step as ref_beam_step  # noqa: E402
from reference.sampling import sample as ref_sample  # noqa: E402

from mindie import _C, ops  # noqa: E402


def timeit(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) milliseconds per call after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def sampling_batch(
    rows: int, vocab: int, gen: torch.Generator, penalties: bool
) -> dict[str, torch.Tensor]:
    batch = dict(
        logits=torch.randn(rows, vocab, generator=gen) * 3,
        temperature=torch.full((rows,), 0.8),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        seed=torch.arange(rows, dtype=torch.int64) * 7919,
        step=torch.full((rows,), 17, dtype=torch.int64),
    )
    if penalties:  # 512 prompt and 128 output tokens per row
        batch.update(
            repetition_penalty=torch.full((rows,), 1.1),
            presence_penalty=torch.full((rows,), 0.5),
            frequency_penalty=torch.full((rows,), 0.3),
            prompt_tokens=torch.randint(0, vocab, (rows * 512,), generator=gen),
            prompt_offsets=torch.arange(rows + 1, dtype=torch.int64) * 512,
            output_tokens=torch.randint(0, vocab, (rows * 128,), generator=gen),
            output_offsets=torch.arange(rows + 1, dtype=torch.int64) * 128,
        )
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--ref-repeat", type=int, default=5)
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    if args.isa:
        _C.set_isa(args.isa)
    rows, vocab = args.rows, args.vocab
    gen = torch.Generator().manual_seed(0)
    print(
        f"isa={_C.get_isa()} kernel threads={_C.get_num_threads()} "
        f"torch threads={torch.get_num_threads()} rows={rows} vocab={vocab}"
    )
    print(f"{'case':44s} {'kernel ms (median/min)':>24s} {'reference ms':>14s} {'speed-up':>9s}")

    pen = sampling_batch(rows, vocab, gen, penalties=True)
    cases: list[tuple[str, dict[str, torch.Tensor], int]] = []

    def variant(**fields: object) -> dict[str, torch.Tensor]:
        b = dict(pen)
        for k, v in fields.items():
            b[k] = torch.full((rows,), v, dtype=b[k].dtype)  # type: ignore[arg-type]
        return b

    cases.append(("penalties + top-k 50", variant(top_k=50), 0))
    cases.append(("penalties + top-p 0.9 (top-k off)", variant(top_p=0.9), 0))
    cases.append(("penalties + top-k 50 + top-p 0.9", variant(top_k=50, top_p=0.9), 0))
    cases.append(("penalties + greedy", variant(temperature=0.0), 0))
    cases.append(("penalties + top-k 50 + top-N 20 logprobs", variant(top_k=50), 20))
    cases.append(
        ("no penalties, plain sampling (no filter)", sampling_batch(rows, vocab, gen, False), 0)
    )
    for name, batch, n in cases:
        k_med, k_min = timeit(lambda b=batch, n=n: ops.sample(**b, num_logprobs=n), args.repeat)
        r_med, _ = timeit(lambda b=batch, n=n: ref_sample(**b, num_logprobs=n), args.ref_repeat)
        print(f"{name:44s} {k_med:11.3f} / {k_min:8.3f} {r_med:14.2f} {r_med / k_med:8.0f}x")

    groups, width = 4, 4
    logprobs = torch.log_softmax(torch.randn(groups * width, vocab, generator=gen) * 2, dim=-1)
    beam_scores = -torch.rand(groups * width, generator=gen) * 5

    def kernel_beam() -> None:
        state = ops.BeamSearchState.new(groups, width)
        ops.beam_search_step(logprobs, beam_scores, state, [2], cur_len=5, length_penalty=1.0)

    def reference_beam() -> None:
        hyps = [BeamHypotheses(width, 1.0, False) for _ in range(groups)]
        ref_beam_step(
            logprobs, beam_scores, hyps, [False] * groups, [()] * (groups * width), [2], 5, 2
        )

    k_med, k_min = timeit(kernel_beam, args.repeat)
    r_med, _ = timeit(reference_beam, args.ref_repeat)
    name = f"beam step G={groups} W={width}"
    print(f"{name:44s} {k_med:11.3f} / {k_min:8.3f} {r_med:14.2f} {r_med / k_med:8.0f}x")


if __name__ == "__main__":
    main()
