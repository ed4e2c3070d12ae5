"""Quantized matmul throughput on the embedded model's own weights, beside the machine's read bandwidth.

    python benchmarks/bench_quant.py [--model GGUF]

GEMV (batch 1): every projection of the model back to back, as one decode step reads them (more
bytes than the last-level cache holds) and in the calls it makes (q/k/v and gate/up share one), in
GB/s of weight bytes and as a share of the read bandwidth measured just before it; on a shared host
that bandwidth moves from run to run, so the two are measured in alternation, 5 times, and the
median share is printed with its range. GEMM: one
layer's gate and down projections at 16 and 512 rows, in GFLOP/s, with int8 activations and, where
the variant has native bf16 dot products, bf16 ones (on AMX tiles and on vdpbf16ps, where the CPU has
AMX-BF16); beside them torch's bf16 `linear` over a dense
bf16 copy of the same matrix (the `--quantization none --dtype bfloat16` path). Once per ISA variant.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import bench, memory_read_bandwidth

from mindie import _C, ops
from mindie.model.loader import load_model

# A layer's projections as the forward step calls them: those that share an input in one call.
PROJECTIONS = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
               ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    model = load_model(ap.parse_args().model).model
    print(f"kernel threads {_C.get_num_threads()}")
    groups = [[model.matrices[f"model.layers.{i}.{name}.weight"] for name in group]
              for i in range(model.config.num_layers) for group in PROJECTIONS] + [[model.lm_head]]
    total = sum(w.nbytes for group in groups for w in group)
    inputs = {k: ops.quantize_activations(torch.randn(1, k)) for k in {g[0].cols for g in groups}}
    calls = [([torch.empty(1, w.rows) for w in g], *inputs[g[0].cols], [w.spec() for w in g]) for g in groups]
    gate = model.matrices["model.layers.0.mlp.gate_proj.weight"]
    down = model.matrices["model.layers.0.mlp.down_proj.weight"]
    for isa in _C.available_isas():
        _C.set_isa(isa)

        def step() -> None:
            for outs, q, d, specs in calls:
                _C.qmatmul_group(outs, q, d, specs)

        rounds = 5 if isa != "scalar" else 1
        pairs = []
        for _ in range(rounds):
            bandwidth = memory_read_bandwidth()
            pairs.append((bench(step, min_time=0.5 if isa != "scalar" else 0.0, warmup=1), bandwidth))
        pairs.sort(key=lambda tb: total / tb[0] / tb[1])
        t, bandwidth = pairs[len(pairs) // 2]
        shares = [100 * total / t_ / b_ for t_, b_ in pairs]
        print(f"[{isa}] GEMV, all {sum(map(len, groups))} matrices in {len(groups)} calls ({total / 1e6:.0f} MB): "
              f"{t * 1e3:7.2f} ms, "
              f"{total / t / 1e9:5.1f} GB/s = {100 * total / t / bandwidth:3.0f}% of the {bandwidth / 1e9:.1f} GB/s "
              f"read bandwidth measured beside it (median of {rounds}; {min(shares):.0f}-{max(shares):.0f}%; "
              f"bandwidth {min(b for _, b in pairs) / 1e9:.1f}-{max(b for _, b in pairs) / 1e9:.1f} GB/s)")
        for w in (gate, down):
            packed_rows = w.rows if w.packed else None
            for m in (16, 512):
                x = torch.randn(m, w.cols)
                q, d = ops.quantize_activations(x)
                forms = {"int8": lambda: ops.qmatmul(q, d, w.data, w.ggml_type, packed_rows=packed_rows)}
                if _C.qmatmul_bf16_native():
                    xb = x.bfloat16()

                    def bf16(tiles: bool) -> None:
                        _C.set_amx(tiles)
                        try:
                            ops.qmatmul_bf16(xb, w.data, w.ggml_type, packed_rows=packed_rows)
                        finally:
                            _C.set_amx(True)

                    if _C.cpu_features()["amx_bf16"]:
                        forms["bf16 (AMX tiles)"] = lambda: bf16(True)
                    forms["bf16 (vdpbf16ps)"] = lambda: bf16(False)
                flops = 2 * m * w.rows * w.cols
                figures = ", ".join(f"{name} {flops / bench(fn, min_time=0.3, warmup=1) / 1e9:6.1f}"
                                    for name, fn in forms.items())
                print(f"[{isa}] GEMM {w.format_name} [{m} x {w.cols}] x [{w.cols} x {w.rows}] GFLOP/s: {figures}")
    for w in (gate, down):
        dense = ops.dequantize(w.data, w.ggml_type, w.cols, w.rows if w.packed else None).bfloat16()
        xb = torch.randn(512, w.cols).bfloat16()
        t = bench(lambda: F.linear(xb, dense), min_time=0.3, warmup=1)
        print(f"[torch] bf16 linear [512 x {w.cols}] x [{w.cols} x {w.rows}] over a dense copy: "
              f"{2 * 512 * w.rows * w.cols / t / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
