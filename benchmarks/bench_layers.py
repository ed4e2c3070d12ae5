"""Fused per-token layers against the torch ops a model would otherwise run.

    python benchmarks/bench_layers.py

Shapes of the default model (SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536) at
one token (decode, batch 1), 32 tokens (decode batch) and 512 tokens (a prefill chunk).
"""

from __future__ import annotations

import torch
from common import bench, fmt_ms

from mindie import _C, ops


def torch_rms_norm(x, weight, eps, residual):
    x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def torch_rotary(positions, q, k, cos_sin):
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None].repeat(1, 1, 2), sin[:, None].repeat(1, 1, 2)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    return rot(q), rot(k)


def main() -> None:
    print(f"kernel variant: {_C.get_isa()}, kernel threads: {_C.get_num_threads()}, "
          f"torch threads: {torch.get_num_threads()}")
    hidden, heads, kv_heads, d, inter = 576, 9, 3, 64, 1536
    cos_sin = torch.randn(8192, d)
    for tokens in (1, 32, 512):
        print(f"\n{tokens} tokens, bf16")
        x = torch.randn(tokens, hidden).bfloat16()
        res = torch.randn(tokens, hidden).bfloat16()
        w = torch.randn(hidden).bfloat16()
        out = torch.empty_like(x)
        cases = [
            ("rms_norm + residual", lambda: ops.rms_norm(x, w, 1e-5, res, out=out),
             lambda: torch_rms_norm(x, w, 1e-5, res)),
        ]
        q = torch.randn(tokens, heads, d).bfloat16()
        k = torch.randn(tokens, kv_heads, d).bfloat16()
        pos = torch.randint(0, 8192, (tokens,))
        cases.append(("rotary (neox)", lambda: ops.rotary_embedding(pos, q, k, cos_sin),
                      lambda: torch_rotary(pos, q, k, cos_sin)))
        gu = torch.randn(tokens, 2 * inter).bfloat16()
        act = torch.empty(tokens, inter).bfloat16()
        cases.append(("silu_and_mul", lambda: ops.silu_and_mul(gu, out=act),
                      lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]))
        for name, ours, theirs in cases:
            t_ours, t_torch = bench(ours, min_time=0.3), bench(theirs, min_time=0.3)
            print(f"  {name:22s} mindie._C {fmt_ms(t_ours)}   torch {fmt_ms(t_torch)}   x{t_torch / t_ours:.2f}")


if __name__ == "__main__":
    main()
