from __future__ import annotations

import pytest
import torch
from reference.linear import linear as ref_linear

from mindie import ops

TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1.6e-2)}


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (3, 37, 45), (8, 17, 32), (2, 1, 1), (1, 49, 1536), (0, 5, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(isa, x_dtype, w_dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    b = torch.randn(n, generator=gen).to(w_dtype) if with_bias else None
    atol, rtol = TOL[x_dtype]
    torch.testing.assert_close(ops.linear(x, w, b), ref_linear(x, w, b), atol=atol * k**0.5, rtol=rtol)


def test_strided_rows(isa):
    x = torch.randn(4, 64)[:, :32]
    out = torch.zeros(4, 20)[:, :10]
    w = torch.randn(10, 32)
    ops.linear(x, w, out=out)
    torch.testing.assert_close(out, ref_linear(x, w), atol=1e-4, rtol=1e-5)


def test_bad_arguments_raise():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="in_features"):
        ops.linear(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="bias"):
        ops.linear(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="bias: dtype"):
        ops.linear(x, w, torch.randn(4).bfloat16())
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.linear(x.double(), w)
    with pytest.raises(ValueError, match="contiguous"):
        ops.linear(x, torch.randn(8, 4).T)
    with pytest.raises(ValueError, match="out"):
        ops.linear(x, w, out=torch.empty(2, 4, dtype=torch.bfloat16))
