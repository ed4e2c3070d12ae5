"""The kernels' thread pool: whatever the pool size, whether its workers spin, sleep or are not
scheduled (more threads than cores), and however many Python threads call at once, every chunk of
every job runs exactly once and a kernel's result keeps its bits."""

from __future__ import annotations

import threading
import time

import torch
from helpers.quant_blocks import in_layout, random_blocks

from mindie import _C, ops


def call_repeatedly(seed: int, inputs: list, weight: tuple, want: list[torch.Tensor], failures: list[str]) -> None:
    for i in range(60):
        j = (seed + i) % len(inputs)
        if not torch.equal(qmatmul(inputs[j], weight), want[j]):
            failures.append(f"caller {seed}, call {i}")
        if i % 20 == 19:
            time.sleep(0.002)  # past the workers' spin: they go to sleep and are woken


def qmatmul(inputs: tuple, weight: tuple) -> torch.Tensor:
    data, qtype, layout = weight
    return ops.qmatmul(*inputs, data, qtype, **layout)


def test_results_keep_their_bits_on_any_pool_from_concurrent_callers():
    data, qtype = random_blocks("Q4_1", 77, 576, 1)  # 5 panels: one job chunk per thread or fewer
    packed, layout = in_layout(data, qtype, packed=True)  # up to 8 rows stream from the panels
    weight = (packed, qtype, layout)
    inputs = [ops.quantize_activations(torch.randn(m, 576, generator=torch.Generator().manual_seed(m)))
              for m in (1, 3, 20, 40)]  # streamed rows, panel tiles; up to 3 chunks of activation sums
    threads = _C.get_num_threads()
    try:
        _C.set_num_threads(1)
        want = [qmatmul(x, weight) for x in inputs]
        for size in (2, 3, 5):
            _C.set_num_threads(size)
            failures: list[str] = []
            callers = [threading.Thread(target=call_repeatedly, args=(s, inputs, weight, want, failures))
                       for s in range(4)]
            for t in callers:
                t.start()
            for t in callers:
                t.join()
            assert not failures, (size, failures[:5])
    finally:
        _C.set_num_threads(threads)
