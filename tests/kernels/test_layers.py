from __future__ import annotations

import pytest
import torch
from reference import layers as ref

from mindie import ops

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 33), (0, 16), (3, 1)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(isa, dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    expected, expected_res = ref.rms_norm(x, weight, 1e-5, residual)
    res = residual.clone() if residual is not None else None
    out = ops.rms_norm(x, weight, 1e-5, res)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    if with_residual:
        assert torch.equal(res, expected_res)


def test_rms_norm_in_place_on_strided_rows(isa):
    x = torch.randn(4, 64)[:, :32]  # row stride 64
    expected, _ = ref.rms_norm(x.clone(), torch.ones(32), 1e-6)
    ops.rms_norm(x, torch.ones(32), 1e-6, out=x)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 16, 128), (9, 3, 40), (0, 2, 8), (5, 1, 7)])
def test_head_rms_norm(isa, dtype, weight_dtype, tokens, heads, head_dim):
    """Each head of q and of k, strided views of a fused q/k/v output, normalised as a row of its own;
    the v columns are left alone."""
    gen = torch.Generator().manual_seed(tokens * heads + head_dim)
    qkv = (torch.randn(tokens, 3 * heads, head_dim, generator=gen) * 3).to(dtype)
    q_weight, k_weight = (torch.rand(2, head_dim, generator=gen) + 0.5).to(weight_dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    want_q, _ = ref.rms_norm(q, q_weight, 1e-6)
    want_k, _ = ref.rms_norm(k, k_weight, 1e-6)
    v_before = v.clone()
    ops.head_rms_norm(q, q_weight, 1e-6)
    ops.head_rms_norm(k, k_weight, 1e-6)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q, want_q.to(dtype), atol=atol, rtol=rtol)
    torch.testing.assert_close(k, want_k.to(dtype), atol=atol, rtol=rtol)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
# (16, 12) the tiny Phi-3's partial rotary, (128, 96) Phi-4-mini's
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (32, 16), (6, 6), (16, 12), (128, 96)])
def test_rotary_embedding(isa, dtype, neox, head_dim, rot_dim):
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    tokens, q_heads, k_heads = 9, 6, 2
    cache = ref.cos_sin_cache(100, rot_dim)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    qkv = torch.randn(tokens, q_heads + 2 * k_heads, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :q_heads], qkv[:, q_heads : q_heads + k_heads]  # strided views of a fused output
    exp_q, exp_k = ref.rotary_embedding(positions, q, cache, neox), ref.rotary_embedding(positions, k, cache, neox)
    v_before = qkv[:, q_heads + k_heads :].clone()
    ops.rotary_embedding(positions, q, k, cache, neox)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(q, exp_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, exp_k, atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, q_heads + k_heads :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (5, 17), (0, 8)])
def test_silu_and_mul(isa, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (5, 17), (0, 8)])
def test_gelu_tanh_and_mul(isa, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens + inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    x[:, :3] = torch.tensor([-100.0, 0.0, 60.0])[: min(3, x.shape[1])].to(dtype)  # far tails: 0 and x, never NaN
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), atol=atol, rtol=rtol)


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="hidden size"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, torch.ones(8), 1e-5, residual=torch.zeros(2, 8))
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-5)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    cache = torch.randn(10, 8)
    with pytest.raises(ValueError, match="out of range"):
        ops.rotary_embedding(torch.tensor([0, 10]), q, k, cache)
    with pytest.raises(ValueError, match="rot_dim"):
        ops.rotary_embedding(torch.tensor([0, 1]), q, k, torch.randn(10, 12))
    with pytest.raises(TypeError, match="int64"):
        ops.rotary_embedding(torch.tensor([0, 1], dtype=torch.int32), q, k, cache)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even"):
        ops.gelu_tanh_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="head_dim"):
        ops.head_rms_norm(q, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        ops.head_rms_norm(q.transpose(1, 2), torch.ones(4), 1e-6)
