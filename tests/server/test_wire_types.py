"""The seam's wire-level modules (each family's parse and render, the engine's request and output
types, the results renderers consume) and the coordinator load without torch, mindie._C or the
engine, so a process that only routes requests can import them; and no API family imports another."""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import mindie.coordinator as coordinator
import mindie.server.protocols as protocols

PROTOCOLS = [f"mindie.server.protocols.{m.name}" for m in pkgutil.iter_modules(protocols.__path__)]
COORDINATOR = [f"mindie.coordinator.{m.name}" for m in pkgutil.iter_modules(coordinator.__path__)]
WIRE = ["mindie.engine.request", "mindie.engine.stats", "mindie.server.results", "mindie.server.http",
        "mindie.pd.records", "mindie.pd.params", "mindie.pd.http", *PROTOCOLS, *COORDINATOR]
HEAVY = ["torch", "mindie._C", "mindie.engine.engine"]
# module -> its family; modules outside this table are shared by several families
FAMILIES = {"native": "native", "tgi": "tgi", "vllm": "vllm", "triton": "triton", "openai": "openai",
            "openai_chat": "openai", "openai_family": "openai", "openai_completions": "openai",
            "openai_responses": "openai", "responses_request": "openai", "responses_store": "openai"}


def test_wire_modules_load_without_torch_or_the_engine():
    code = ("import importlib, json, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-P", "-c", code, *WIRE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_no_family_imports_another():
    for path in Path(protocols.__path__[0]).glob("*.py"):
        family = FAMILIES.get(path.stem)
        if family is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == protocols.__name__:
                names = [a.name for a in node.names]  # from mindie.server.protocols import x
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").removeprefix(protocols.__name__ + ".")]
            elif isinstance(node, ast.Import):
                names = [a.name.removeprefix(protocols.__name__ + ".") for a in node.names]
            else:
                continue
            for name in names:
                assert FAMILIES.get(name, family) == family, f"{path.name} imports {name}"


def test_max_top_logprobs_is_the_kernels():
    from mindie import _C
    from mindie.engine.request import MAX_TOP_LOGPROBS

    assert MAX_TOP_LOGPROBS == _C.MAX_TOP_LOGPROBS
