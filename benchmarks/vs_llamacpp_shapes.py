"""Our engine against llama.cpp at the shapes people serve, beside the machine's limits (issue 24).

    python benchmarks/vs_llamacpp_shapes.py --llama-bin DIR [--shapes llama-3.2-1b,smollm2-1.7b]
                                            [--formats Q4_K_M,Q4_0] [--rounds 3] [--repetitions 3] [--threads N]
                                            [--cache DIR] [--no-vnni] [--depth N] [--activation-bits 16|8]

Each shape is a GGUF with random weights, F16: a Llama-architecture one (../shared/tools/make-synthetic-gguf.py),
or a Qwen3, Qwen3-MoE or Gemma 3 one (benchmarks/make_family_gguf.py: qwen3-1.7b, qwen3-4b, gemma-3-1b, and
qwen3-30b-a3b-32e, Qwen3-30B-A3B's layers with 32 of its 128 experts), quantized by llama-quantize from DIR;
both are made once into --cache (default ~/.cache/mindie-bench),
outside the repository. Per file and round, interleaved so that a noisy stretch of the machine hits both:
  the read bandwidth (torch summing 1 GB, benchmarks/common.py) and the dot-product peak (a register-only
  loop of the instruction our prefill kernel uses, _C.dot_peak);
  prefill of 512 tokens   llama-bench -p 512 -n 0   against LLM.generate(max_tokens=1)
  batch-1 decode, 128     llama-bench -p 0 -n 128   against engine steps after the first token
  and with --depth N, the same decode after an N-token prompt   llama-bench -p 0 -n 128 -d N
then the medians with our/their ratio and each side's share of its limit: decode as the weight bytes
one token reads (every tensor but the embedding table, of which a row; at depth N also the keys and
values of its mean context, 16-bit in both caches) x tok/s over the bandwidth measured just before and
just after that side's run (their mean: the host's read rate can change within a round);
prefill as the matmul FLOPs per prompt token (2 x the layers' weights, plus attention at the mean
context; the lm_head runs for the last token alone) x tok/s over the peak.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
from common import memory_read_bandwidth
from make_family_gguf import SHAPES as FAMILY_SHAPES
from vs_llamacpp import DECODE, PREFILL, cpu_summary, llama_bench_any, our_decode, our_prefill, random_ids

from mindie import _C, LLM, SamplingParams
from mindie.model.gguf_header import read_header
from mindie.model.llama_quant import activation_planes, int8_prompt_instruction, prompt_rows_in_bf16
from mindie.model.loader import default_model_path

# make-synthetic-gguf.py's arguments per public model.
SHAPES: dict[str, dict[str, int]] = {
    "llama-3.2-1b": {"hidden": 2048, "layers": 16, "heads": 32, "kv-heads": 8, "ffn": 8192},
    "smollm2-1.7b": {"hidden": 2048, "layers": 24, "heads": 32, "kv-heads": 32, "ffn": 8192},
    "llama-3.2-3b": {"hidden": 3072, "layers": 28, "heads": 24, "kv-heads": 8, "ffn": 8192},
    "llama-3.1-8b": {"hidden": 4096, "layers": 32, "heads": 32, "kv-heads": 8, "ffn": 14336},
}
TOOLS = Path(__file__).resolve().parents[2] / "shared" / "tools"
KNOWN = [*SHAPES, *FAMILY_SHAPES]


def model_file(args: argparse.Namespace, shape: str, fmt: str) -> Path:
    """The cached GGUF of `shape` in `fmt`, made (F16, then quantized) when absent."""
    out = args.cache / f"{shape}-{fmt.lower()}.gguf"
    if out.is_file():
        return out
    args.cache.mkdir(parents=True, exist_ok=True)
    f16 = args.cache / f"{shape}-f16.gguf"
    if not f16.is_file():
        print(f"writing {f16} ...", flush=True)
        if shape in FAMILY_SHAPES:
            command = [str(Path(__file__).with_name("make_family_gguf.py")), shape, str(f16) + ".part"]
        else:
            dims = [a for k, v in SHAPES[shape].items() for a in (f"--{k}", str(v))]
            command = [str(args.tools / "make-synthetic-gguf.py"), str(default_model_path()), str(f16) + ".part", *dims]
        subprocess.run([sys.executable, *command], check=True, stdout=subprocess.DEVNULL)
        os.replace(str(f16) + ".part", f16)
    print(f"quantizing {out.name} ...", flush=True)
    subprocess.run([str(args.llama_bin / "llama-quantize"), str(f16), str(out) + ".part", fmt, str(args.threads)],
                   check=True, capture_output=True, env={**os.environ, "LD_LIBRARY_PATH": str(args.llama_bin)})
    os.replace(str(out) + ".part", out)
    return out


def per_token_work(path: Path) -> tuple[int, float, str, int]:
    """(bytes a decode token reads, prefill FLOPs per token of a PREFILL-token prompt, formats, bytes of
    16-bit keys and values a token adds to the cache) of a GGUF. An MoE layer's experts count at their
    active share (expert_used_count of expert_count)."""
    header = read_header(str(path))
    f = header.fields
    arch = f["general.architecture"]
    layers, hidden = f[f"{arch}.block_count"], f[f"{arch}.embedding_length"]
    heads = f[f"{arch}.attention.head_count"]
    head_dim = f.get(f"{arch}.attention.key_length", hidden // heads)
    kv_bytes = 2 * layers * f.get(f"{arch}.attention.head_count_kv", heads) * head_dim * 2
    active = f[f"{arch}.expert_used_count"] / f[f"{arch}.expert_count"] if f"{arch}.expert_count" in f else 1.0
    tensors = {t.name: t for t in header.tensors}
    ends = sorted(t.offset for t in header.tensors) + [len(header.data)]
    size = {t.name: ends[ends.index(t.offset) + 1] - t.offset for t in header.tensors}  # with alignment padding
    share = {t.name: active if t.name.endswith("_exps.weight") else 1.0 for t in header.tensors}
    read = int(sum(n * share[name] for name, n in size.items()
                   if name != "token_embd.weight" or "output.weight" not in tensors))
    params = sum(math.prod(t.shape) * share[t.name] for t in header.tensors
                 if t.name.startswith("blk.") and len(t.shape) >= 2)
    attention = 4 * layers * hidden * (PREFILL + 1) / 2  # q.k and p.v at the mean context
    formats: dict[str, int] = {}
    for t in header.tensors:
        if len(t.shape) >= 2:
            name = _qtype_name(t.qtype)
            formats[name] = formats.get(name, 0) + 1
    return read, 2 * params + attention, ", ".join(f"{k} x{v}" for k, v in sorted(formats.items())), kv_bytes


def _qtype_name(qtype: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name


def prefill_instruction(vnni: bool = True, activation_bits: int = 16) -> str:
    """The dot-product instruction our prompt rows run on here (the engine's defaults; vnni=False as
    after _C.set_vnni(False))."""
    planes = activation_planes(activation_bits)
    if prompt_rows_in_bf16(planes):
        return "tdpbf16ps" if _C.cpu_features()["amx_bf16"] else "vdpbf16ps"
    return int8_prompt_instruction(planes, vnni)


def run_file(args: argparse.Namespace, path: Path) -> list[str]:
    """Table rows for one GGUF: its rounds, interleaved, then medians."""
    read, flops, formats, kv_bytes = per_token_work(path)
    instr = prefill_instruction(not args.no_vnni, args.activation_bits)
    print(f"\n== {path.name}: {path.stat().st_size / 1e9:.2f} GB ({formats}); a decode token reads "
          f"{read / 1e9:.3f} GB, a prompt token costs {flops / 1e9:.2f} GFLOP", flush=True)
    llm = LLM(str(path), activation_bits=args.activation_bits, enablePrefixCache=False)
    vocab = llm.engine.loaded.config.vocab_size
    llm.generate({"prompt_token_ids": random_ids(64, 0, vocab)}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    bench_args = argparse.Namespace(llama_bin=args.llama_bin, model=str(path), threads=args.threads)
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        measured = {"bandwidth": memory_read_bandwidth(), "peak": 2 * _C.dot_peak(instr, args.threads)}
        measured["llama prefill"] = llama_bench_any(bench_args, PREFILL, 0, args.repetitions)
        measured["ours prefill"] = our_prefill(llm, random_ids(PREFILL, 100 + r, vocab), args.repetitions)
        # The host's read rate can change within a round, so each decode figure gets the bandwidth
        # measured just before and just after it (their mean): a share then compares a side with the
        # memory it met, not with the one the round began with.
        decodes = {"llama decode": partial(llama_bench_any, bench_args, 0, DECODE, args.repetitions),
                   "ours decode": partial(our_decode, llm, random_ids(16, 200 + r, vocab), f"decode-{r}")}
        if args.depth:
            decodes["llama deep"] = partial(llama_bench_any, bench_args, 0, DECODE, args.repetitions,
                                            ("-d", str(args.depth)))
            decodes["ours deep"] = partial(our_decode, llm, random_ids(args.depth, 300 + r, vocab), f"deep-{r}")
        before = measured["bandwidth"]
        for key, run in decodes.items():
            measured[key] = run()
            after = memory_read_bandwidth()
            measured[f"bandwidth {key}"] = (before + after) / 2
            before = after
        for key, value in measured.items():
            results.setdefault(key, []).append(value)
        print(f"round {r + 1}/{args.rounds}: bandwidth {measured['bandwidth'] / 1e9:.1f} GB/s, {instr} peak "
              f"{measured['peak'] / 1e9:.0f} GFLOP/s; " + ", ".join(
                  f"{k} {v / 1e9:.1f} GB/s" if k.startswith("bandwidth ") else f"{k} {v:.1f}"
                  for k, v in measured.items() if k not in ("bandwidth", "peak")), flush=True)
    del llm
    med = {k: statistics.median(v) for k, v in results.items()}
    rows = []
    # Per figure: work per token and each side's limit (the peak, or the bandwidth around its decode).
    figures = [("prefill", f"prefill {PREFILL}", flops, med["peak"], med["peak"], f"{instr} peak")]
    figures.append(("decode", f"decode b1 {DECODE}", read, med["bandwidth llama decode"],
                    med["bandwidth ours decode"], "read bandwidth around each side's run"))
    if args.depth:
        deep_read = read + kv_bytes * (args.depth + DECODE / 2)
        figures.append(("deep", f"decode @{args.depth}", deep_read, med["bandwidth llama deep"],
                        med["bandwidth ours deep"], "read bandwidth around each side's run"))
    for fig, name, per_token, their_limit, our_limit, unit in figures:
        ours, theirs = med[f"ours {fig}"], med[f"llama {fig}"]
        limits = (f"{our_limit / 1e9:.0f}" if fig == "prefill"
                  else f"{their_limit / 1e9:.0f} / {our_limit / 1e9:.0f}")
        rows.append(f"{path.name:<28} {name:<16} "
                    f"{theirs:9.1f} {ours:9.1f} {ours / theirs:7.2f}x "
                    f"{100 * theirs * per_token / their_limit:6.0f}% {100 * ours * per_token / our_limit:6.0f}%   "
                    f"{limits} {'GFLOP/s' if fig == 'prefill' else 'GB/s'} {unit}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder holding llama-bench and llama-quantize")
    ap.add_argument("--shapes", default="llama-3.2-1b,smollm2-1.7b", help=f"comma-separated, of {', '.join(KNOWN)}")
    ap.add_argument("--formats", default="Q4_K_M,Q4_0", help="llama-quantize types, comma-separated")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mindie-bench")
    ap.add_argument("--tools", type=Path, default=TOOLS, help="folder holding make-synthetic-gguf.py")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repetitions", type=int, default=3,
                    help="per round: llama-bench -r and our prefill runs (each side's median/mean of them)")
    ap.add_argument("--depth", type=int, default=0,
                    help="also batch-1 decode after a prompt of this many tokens (the attention at long contexts)")
    ap.add_argument("--no-vnni", action="store_true",
                    help="our int8 products without VNNI, as on a CPU that lacks it (MINDIE_ISA picks the variant)")
    ap.add_argument("--activation-bits", type=int, choices=[16, 8], default=16,
                    help="our int8 activations: 16 (two planes, the default) or 8 (one, as llama.cpp)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in KNOWN]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(KNOWN)}")
    if missing := [b for b in ("llama-bench", "llama-quantize") if not (args.llama_bin / b).is_file()]:
        ap.error(f"{', '.join(missing)} not found in {args.llama_bin} (build with ../shared/tools/build-llamacpp.sh)")

    torch.set_num_threads(args.threads)
    _C.set_num_threads(args.threads)
    _C.set_vnni(not args.no_vnni)
    print(f"CPU: {cpu_summary()}")
    print(f"threads: {args.threads} (llama.cpp -t, our kernel pool {_C.get_num_threads()}); our kernel variant "
          f"{_C.get_isa()}, prefill rows on {prefill_instruction(not args.no_vnni, args.activation_bits)}; "
          f"activation bits {args.activation_bits}")
    files = [model_file(args, s, f) for s in shapes for f in args.formats.split(",")]
    rows = [row for path in files for row in run_file(args, path)]
    print(f"\nmedians over {args.rounds} interleaved round(s), {args.threads} threads; tok/s, and each side's "
          f"share of the limit named")
    if prefill_instruction(not args.no_vnni, args.activation_bits) in ("vpdpwssd", "vpmaddwd"):
        _C.set_vnni(True)  # llama.cpp's instructions, whatever ours are told (dot_peak follows set_vnni)
        byte_peaks = ", ".join(f"{i} {2 * _C.dot_peak(i, args.threads) / 1e9:.0f}" for i in ("vpmaddubsw", "vpdpbusd")
                               if _C.dot_peak(i, 1, 0.01) > 0)
        _C.set_vnni(not args.no_vnni)
        print(f"(our int8 prompt rows' two planes meet each weight as one int16, 128 * hi + lo: one "
              f"{prefill_instruction(not args.no_vnni)} product, a ceiling of the peak named; llama.cpp's one byte "
              f"plane runs on vpmaddubsw, or vpdpbusd in a build for VNNI; their peaks here, GFLOP/s: {byte_peaks})")
    print(f"{'model':<28} {'figure':<16} {'llama.cpp':>9} {'ours':>9} {'ratio':>8} {'llama%':>7} {'ours%':>7}   limit")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
