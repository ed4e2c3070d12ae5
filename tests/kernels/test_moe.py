"""The MoE routing kernels against plain PyTorch (tests/reference/moe.py), on every kernel variant."""

from __future__ import annotations

import pytest
import torch
from reference import moe as ref

from mindie import ops


@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (37, 8, 2), (5, 4, 4), (0, 8, 2), (9, 60, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route(isa, tokens, experts, k, normalize):
    gen = torch.Generator().manual_seed(tokens * experts + k)
    logits = torch.randn(tokens, experts, generator=gen) * 4
    want_w, want_ids = ref.moe_route(logits, k, normalize)
    got_w, got_ids = ops.moe_route(logits, k, normalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
    if normalize and tokens:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(tokens), atol=1e-6, rtol=0)


def test_moe_route_reads_strided_rows(isa):
    """Router logits may be a column slice of a wider output; only the row's own columns count."""
    wide = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 4:20]
    want_w, want_ids = ref.moe_route(logits.contiguous(), 3, True)
    got_w, got_ids = ops.moe_route(logits, 3, True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens,experts,k,hidden", [(1, 128, 8, 2048), (23, 8, 2, 64), (4, 5, 3, 37), (0, 4, 2, 16)])
def test_moe_combine(isa, tokens, experts, k, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = ref.moe_route(logits, k, True)
    y = torch.randn(tokens * k, hidden, generator=gen)
    got = ops.moe_combine(y, weights, ids)
    torch.testing.assert_close(got, ref.moe_combine(y, weights, ids), atol=1e-5, rtol=1e-5)


def test_moe_combine_row_is_batch_invariant(isa):
    """A row's sum is the same bits alone and in a batch: its terms go in its own expert order."""
    gen = torch.Generator().manual_seed(5)
    weights, ids = ref.moe_route(torch.randn(16, 32, generator=gen), 4, True)
    y = torch.randn(16 * 4, 96, generator=gen)
    batch = ops.moe_combine(y, weights, ids)
    for t in (0, 7, 15):
        row = slice(t, t + 1)
        alone = ops.moe_combine(y[4 * t:4 * t + 4].contiguous(), weights[row].contiguous(), ids[row].contiguous())
        assert torch.equal(alone[0], batch[t])
