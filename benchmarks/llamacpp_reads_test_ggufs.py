"""The tests' tiny GGUF files (tests/helpers/tiny_gguf.py writes each family as llama.cpp's
convert_hf_to_gguf.py names and lays it out) loaded and run by llama.cpp's llama-bench, to show they
are files llama.cpp reads (issue 27). Not a test: it needs llama.cpp (../shared/tools/build-llamacpp.sh).

    python benchmarks/llamacpp_reads_test_ggufs.py --llama-bin DIR

Per family: the tiny random model the tests build, its GGUF in F32 and in Q8_0 (tensors and keys as the
tests write them; the tokenizer padded to the model's vocabulary and given a merge, as llama.cpp's
loader needs), and llama-bench's answer (`-p 8 -n 8`, one thread): tokens per second where it ran,
else the error it printed.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.tiny_gguf import write_gguf  # noqa: E402
from helpers.tiny_models import make_tiny  # noqa: E402

# make_tiny's families that tiny_gguf writes
FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3"]


def bench(llama_bin: Path, model: Path, extra: tuple[str, ...] = ()) -> str:
    run = subprocess.run([str(llama_bin / "llama-bench"), "-m", str(model), "-p", "8", "-n", "8", "-t", "1", "-r", "1",
                          "-o", "csv", *extra], capture_output=True, text=True, env={"LD_LIBRARY_PATH": str(llama_bin)})
    if run.returncode < 0 and not extra:
        # b11434's repacked (AMX) matmuls die by a signal on some CPUs (a KVM Sapphire Rapids guest):
        # again without repacking, which reads the same file
        return bench(llama_bin, model, ("--repack", "0"))
    rows = list(csv.DictReader(io.StringIO(run.stdout)))
    if run.returncode != 0 or not rows:
        lines = [line for line in (run.stderr + run.stdout).splitlines() if "error loading model" in line]
        return "FAILED: " + (lines[-1].strip() if lines else f"exit {run.returncode}")
    return "ran: " + ", ".join(f"pp{r['n_prompt']}+tg{r['n_gen']} {float(r['avg_ts']):.0f} tok/s" for r in rows) + (
        f" ({' '.join(extra)})" if extra else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder holding llama-bench")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for seed, family in enumerate(FAMILIES):
            hf_dir = make_tiny(Path(tmp) / family, family, seed)
            for qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0):
                out = write_gguf(hf_dir, Path(tmp) / f"{family}-{qtype.name}.gguf", qtype, for_llama_cpp=True)
                print(f"{family:<10} {qtype.name:<5} {bench(args.llama_bin, out)}", flush=True)


if __name__ == "__main__":
    main()
