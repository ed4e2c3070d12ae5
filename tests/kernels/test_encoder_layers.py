from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reference import encoder_layers as ref

from mindie import _C, ops

# bfloat16: one rounding of the output apart (float32 math inside, computed in another order)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(params=[1, 2, 3])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = _C.get_num_threads()
    _C.set_num_threads(request.param)
    yield request.param
    _C.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 768), (37, 33), (0, 16), (5, 1), (19, 771)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm(isa, threads, dtype, weight_dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden + threads)
    # an offset mean, as a residual stream has: the variance must not cancel
    x = (torch.randn(rows, hidden, generator=gen) * 3 + 5).to(dtype)
    weight = (torch.randn(hidden, generator=gen) + 1).to(weight_dtype)
    bias = torch.randn(hidden, generator=gen).to(weight_dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    want, want_residual = ref.layer_norm(x, weight, bias, 1e-6, residual)
    got_residual = residual.clone() if residual is not None else None
    got = ops.layer_norm(x, weight, bias, 1e-6, got_residual)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if with_residual:
        assert torch.equal(got_residual, want_residual)


def test_layer_norm_in_place_on_strided_rows(isa):
    x = torch.randn(4, 64)[:, :40]  # row stride 64
    weight, bias = torch.rand(40) + 0.5, torch.randn(40)
    want, _ = ref.layer_norm(x.clone(), weight, bias, 1e-5)
    ops.layer_norm(x, weight, bias, 1e-5, out=x)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 3072), (23, 17), (0, 8), (6, 1), (4, 1000)])
def test_gelu_tanh(isa, threads, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n + threads)
    x = (torch.randn(rows, n, generator=gen) * 4).to(dtype)
    x.view(-1)[:4] = torch.tensor([-100.0, 0.0, 60.0, -8.0])[: x.numel()].to(dtype)  # far tails: 0 and x, never NaN
    want = ref.gelu_tanh(x)
    got = ops.gelu_tanh_(x.clone())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_gelu_tanh_out_of_place_on_strided_rows(isa):
    x = torch.randn(5, 48)[:, :30]
    out = torch.zeros(5, 40)[:, :30]
    _C.gelu_tanh(out, x)
    torch.testing.assert_close(out, ref.gelu_tanh(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.zeros(5, 40)[:, 30:], out.as_strided((5, 10), (40, 1), 30))


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="hidden size"):
        ops.layer_norm(x, torch.ones(7), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="bias"):
        ops.layer_norm(x, torch.ones(8), torch.zeros(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        ops.layer_norm(x, torch.ones(8), torch.zeros(8), 0.0)
    with pytest.raises(ValueError, match="residual"):
        ops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5, residual=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="dtype must match"):
        ops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.gelu_tanh_(x.double())
    with pytest.raises(ValueError, match="contiguous"):
        ops.gelu_tanh_(x.t())
