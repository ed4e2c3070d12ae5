"""Our engine against llama.cpp on the same GGUF, interleaved in one run (issue 9, item 7).

    python benchmarks/vs_llamacpp.py [--llama-bin DIR] [--model GGUF] [--threads N] [--rounds N] [--skip-http]
                                     [--streams 32] [--dtype auto|bfloat16|float32] [--quantization Q]
                                     [--activation-bits 16|8]

Each round measures llama.cpp then ours, figure by figure, so a noisy stretch of the machine hits both:
  prefill of a 512-token prompt   llama-bench -p 512 -n 0   against LLM.generate(max_tokens=1)
  batch-1 decode of 128 tokens    llama-bench -p 0 -n 128   against engine steps after the first token
  N concurrent HTTP streams       llama-server -np N        against `mindie serve`, /v1/completions,
                                  128 prompt / 128 output tokens each (ignore_eos), for each N of
                                  --streams (e.g. 8,32): output tok/s, and the median time to first token
and prints the medians over the rounds with our/their ratio. DIR holds llama-bench and llama-server (built by
../shared/tools/build-llamacpp.sh); without them only our side runs, and the output says why. --dtype,
--quantization and --activation-bits go to LLM(...) and `mindie serve` only when given: by default both run
the engine's defaults (--activation-bits 8: one int8 activation plane, llama.cpp's own precision).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from common import cpu_summary, free_port, memory_read_bandwidth

from mindie import _C, LLM, SamplingParams
from mindie.engine.request import EngineRequest
from mindie.model.loader import default_model_path

HTTP_IN, HTTP_OUT = 128, 128
PREFILL, DECODE = 512, 128


def figures(streams: list[int]) -> list[tuple[str, str]]:
    """(key, label) of each figure a run prints, in order."""
    out = [("prefill", f"prefill {PREFILL} (tok/s)"), ("decode", f"decode batch 1, {DECODE} tok (tok/s)")]
    for n in streams:
        out += [(f"http{n}", f"{n} HTTP streams {HTTP_IN}/{HTTP_OUT} (out tok/s)"),
                (f"ttft{n}", f"{n} HTTP streams, TTFT p50 (s)")]
    return out


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def engine_options(args: argparse.Namespace) -> dict[str, str | int]:
    """LLM(...)'s keyword arguments given on the command line (`mindie serve` takes them as --flags)."""
    options = (("dtype", args.dtype), ("quantization", args.quantization), ("activation_bits", args.activation_bits))
    return {k: v for k, v in options if v is not None}


# --- llama.cpp ---------------------------------------------------------------------------------------------------


def llama_bench(args: argparse.Namespace, n_prompt: int, n_gen: int, extra: tuple[str, ...] = (),
                repetitions: int = 3) -> float:
    """avg_ts of one llama-bench test (its own warm-up run, then `repetitions`); `extra` options appended."""
    cmd = [str(args.llama_bin / "llama-bench"), "-m", args.model, "-p", str(n_prompt), "-n", str(n_gen),
           "-t", str(args.threads), "-r", str(repetitions), "-o", "json", *extra]
    out = subprocess.run(cmd, env={**os.environ, "LD_LIBRARY_PATH": str(args.llama_bin)}, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


def llama_bench_any(args: argparse.Namespace, n_prompt: int, n_gen: int, repetitions: int = 3,
                    extra: tuple[str, ...] = ()) -> float:
    """llama_bench with llama.cpp's defaults, or, where those crash, without its weight repacking:
    b11434's repacked (AMX) matmuls end in SIGSEGV or SIGILL at prompt batches on a KVM Sapphire
    Rapids guest, which `--repack 0` avoids. The fallback is printed, since it may cost llama.cpp speed."""
    try:
        return llama_bench(args, n_prompt, n_gen, extra, repetitions)
    except RuntimeError as e:
        crashes = {"exited with -11:": "SIGSEGV", "exited with -4:": "SIGILL"}
        signal = next((name for text, name in crashes.items() if text in str(e)), None)
        if signal is None:
            raise
        print(f"  llama-bench -p {n_prompt} -n {n_gen} crashed ({signal}) with its defaults; measured with --repack 0",
              flush=True)
        return llama_bench(args, n_prompt, n_gen, (*extra, "--repack", "0"), repetitions)


def missing_llama(args: argparse.Namespace) -> str | None:
    """Why the llama.cpp side cannot run, or None when it can."""
    if args.llama_bin is None:
        return "--llama-bin not given"
    needed = ["llama-bench"] + ([] if args.skip_http else ["llama-server"])
    absent = [b for b in needed if not (args.llama_bin / b).is_file()]
    return f"{', '.join(absent)} not found in {args.llama_bin}" if absent else None


# --- ours, offline -----------------------------------------------------------------------------------------------


def our_prefill(llm: LLM, ids: list[int], runs: int = 3) -> float:
    """Tokens/s of the median of `runs` single-token generations from a PREFILL-token prompt."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return len(ids) / statistics.median(times)


def our_decode(llm: LLM, ids: list[int], request_id: str) -> float:
    """Tokens/s of DECODE tokens after the first (the prefill step's) token, at batch 1."""
    engine = llm.engine
    engine.add_request(EngineRequest(request_id, ids, SamplingParams(max_tokens=DECODE + 1, temperature=0,
                                                                     ignore_eos=True)))
    n, t_first = 0, 0.0
    while engine.has_unfinished():
        n += sum(len(out.new_token_ids) for out in engine.step())
        if n == 1 and not t_first:
            t_first = time.perf_counter()
    elapsed = time.perf_counter() - t_first
    if n != DECODE + 1:
        raise RuntimeError(f"decode produced {n} tokens, expected {DECODE + 1}")
    return DECODE / elapsed


# --- HTTP --------------------------------------------------------------------------------------------------------


def start_servers(args: argparse.Namespace, workdir: Path) -> dict[str, tuple[subprocess.Popen, str, str]]:
    """name -> (process, base URL, readiness URL): llama-server (when compared) first, then `mindie serve`;
    their stderr goes to WORKDIR/NAME.log."""
    threads = str(args.threads)
    launch: dict[str, tuple[list[str], dict[str, str], str, str]] = {}  # name -> (argv, env, base URL, ready URL)
    if not args.skip_llama:
        port = free_port()
        slots = max(args.streams)
        argv = [str(args.llama_bin / "llama-server"), "-m", args.model, "-np", str(slots), "-c",
                str(slots * (HTTP_IN + HTTP_OUT + 16)), "-t", threads, "--host", "127.0.0.1", "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        launch["llama"] = (argv, {"LD_LIBRARY_PATH": str(args.llama_bin)}, url, url + "/health")
    port, mport = free_port(), free_port()
    config = workdir / "config.json"  # prefix cache off: our figures must not ride on cached prompts
    config.write_text(json.dumps({"BackendConfig": {"ScheduleConfig": {"enablePrefixCache": False}}}))
    argv = [sys.executable, "-m", "mindie", "serve", args.model, "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--management-host", "127.0.0.1", "--management-port", str(mport),
            "--metrics-port", str(free_port()), "--model-name", "bench"]
    argv += [a for k, v in engine_options(args).items() for a in (f"--{k.replace('_', '-')}", str(v))]
    launch["ours"] = (argv, {"MINDIE_NUM_THREADS": threads, "OMP_NUM_THREADS": threads},
                      f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/health")
    servers = {}
    for name, (argv, env, url, ready) in launch.items():
        with open(workdir / f"{name}.log", "w") as log:
            # cwd not the repo root: `-m` puts the cwd first on sys.path, and a source tree there shadows the install
            proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **env})
        servers[name] = (proc, url, ready)
    for name, (proc, _, ready) in servers.items():
        deadline, log_path = time.monotonic() + 300, workdir / f"{name}.log"
        while True:
            crashed = proc.poll() is not None and proc.returncode in (-11, -4)
            if crashed and name == "llama" and "--no-repack" not in launch[name][0]:
                # the same crash as llama-bench's repacked matmuls (see llama_bench): again without repacking
                print(f"  llama-server crashed ({'SIGSEGV' if proc.returncode == -11 else 'SIGILL'}) with its "
                      "defaults; serving with --no-repack", flush=True)
                argv, env, _, _ = launch[name]
                launch[name] = ([*argv, "--no-repack"], env, *launch[name][2:])
                with open(log_path, "w") as log:
                    proc = subprocess.Popen(launch[name][0], cwd=workdir, stdout=subprocess.DEVNULL, stderr=log,
                                            env={**os.environ, **env})
                servers[name] = (proc, servers[name][1], ready)
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"{name} server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(ready, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} server not ready after 300 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
    return servers


async def one_stream(client: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[int, float, str | None]:
    """(completion tokens, seconds to the first chunk with text, failure or None) of one streamed
    /v1/completions request."""
    body = {"model": "bench", "prompt": ids, "max_tokens": HTTP_OUT, "n_predict": HTTP_OUT, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}
    tokens, reason, ttft = 0, None, float("nan")
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return 0, ttft, f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft != ttft and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                reason = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), reason)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return tokens, ttft, f"{type(e).__name__}: {e}"
    ok = tokens == HTTP_OUT and reason == "length"
    return tokens, ttft, None if ok else f"{tokens} tokens, finish_reason {reason}"


async def drive(url: str, prompts: list[list[int]]) -> tuple[float, float, list[str]]:
    """Aggregate output tokens/s of all prompts streamed at once, their median time to first token, and the
    failures."""
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, p) for p in prompts))
        wall = time.perf_counter() - t0
    failures = [f"request {i}: {fail}" for i, (_, _, fail) in enumerate(results) if fail]
    ttft = statistics.median(t for _, t, _ in results)
    return sum(n for n, _, _ in results) / wall, ttft, failures


# --- the run -----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, help="folder holding llama-bench and llama-server")
    ap.add_argument("--model", default=str(default_model_path()), help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--streams", default="32", help="comma-separated counts of concurrent HTTP streams")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], help="our activations (default: engine's)")
    ap.add_argument("--quantization", help="our weight quantization, passed through (default: engine's)")
    ap.add_argument("--activation-bits", type=int, choices=[16, 8],
                    help="our int8 activations: 16 (two planes, the default) or 8 (one, as llama.cpp)")
    args = ap.parse_args()
    args.streams = [int(n) for n in args.streams.split(",")]
    why = missing_llama(args)
    args.skip_llama = why is not None

    torch.set_num_threads(args.threads)
    _C.set_num_threads(args.threads)
    print(f"CPU: {cpu_summary()}")
    print(f"threads: {args.threads} (llama.cpp -t, our kernel pool {_C.get_num_threads()}, torch "
          f"{torch.get_num_threads()}); our kernel variant {_C.get_isa()}")
    print(f"memory read bandwidth: {memory_read_bandwidth() / 1e9:.1f} GB/s")
    print(f"model: {args.model}; our options: {engine_options(args) or 'engine defaults'}")
    if why:
        print(f"llama.cpp comparison SKIPPED: {why}; measuring our side only")

    llm = LLM(args.model, enablePrefixCache=False, **engine_options(args))
    vocab = llm.engine.loaded.config.vocab_size
    llm.generate({"prompt_token_ids": random_ids(64, 0, vocab)}, SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    results: dict[tuple[str, str], list[float]] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as workdir:
        servers = {} if args.skip_http else start_servers(args, Path(workdir))
        try:
            for _, url, _ in servers.values():  # warm-up: one short request each
                asyncio.run(drive(url, [random_ids(HTTP_IN, 1, vocab)]))
            for r in range(args.rounds):
                measured: dict[tuple[str, str], float] = {}
                if not args.skip_llama:
                    measured["llama", "prefill"] = llama_bench_any(args, PREFILL, 0)
                measured["ours", "prefill"] = our_prefill(llm, random_ids(PREFILL, 100 + r, vocab))
                if not args.skip_llama:
                    measured["llama", "decode"] = llama_bench_any(args, 0, DECODE)
                measured["ours", "decode"] = our_decode(llm, random_ids(16, 200 + r, vocab), f"decode-{r}")
                for n in args.streams:
                    for i, (name, (_, url, _)) in enumerate(servers.items()):
                        prompts = [random_ids(HTTP_IN, 1000 * (r + 1) + 100 * i + k, vocab) for k in range(n)]
                        tok_s, ttft, failed = asyncio.run(drive(url, prompts))
                        measured[name, f"http{n}"], measured[name, f"ttft{n}"] = tok_s, ttft
                        failures += [f"round {r + 1}, {name}, {n} streams: {f}" for f in failed]
                for key, value in measured.items():
                    results.setdefault(key, []).append(value)
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{side} {fig} {v:.1f}"
                                                                     for (side, fig), v in measured.items()))
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)

    print(f"\nmedians over {args.rounds} interleaved round(s), {args.threads} threads, {Path(args.model).name}")
    print(f"{'figure':<40} {'llama.cpp':>10} {'ours':>10} {'ours/llama':>10}")
    for fig, label in figures(args.streams):
        if ("ours", fig) not in results:
            continue
        ours = statistics.median(results["ours", fig])
        theirs = statistics.median(results["llama", fig]) if ("llama", fig) in results else None
        cells = (f"{theirs:10.1f}", f"{ours / theirs:9.2f}x") if theirs else (f"{'-':>10}", f"{'-':>10}")
        print(f"{label:<40} {cells[0]} {ours:10.1f} {cells[1]}")
    if why:
        print(f"(llama.cpp comparison skipped: {why})")
    if not args.skip_http:
        print(f"HTTP requests not completing with {HTTP_OUT} tokens: {len(failures) or 'none'}")
        for f in failures:
            print(f"  {f}")


if __name__ == "__main__":
    main()
