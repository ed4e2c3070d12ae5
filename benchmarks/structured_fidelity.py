"""Whether constrained output keeps the values the prompt states: "Tom is 31 years old and has 2
cats" through a json_schema response format and through a required tool call, at temperature 0,
against the same facts asked one field at a time (a schema with that field alone), on the
embedded SmolLM2 served by `mindie serve` in a subprocess.

    python benchmarks/structured_fidelity.py [--facts 20] [--seed 0]

Prints, per way of asking, how many stated numbers came back exactly, split into fields that are
not the object's last and the rest. A constrained decoder that replaces the model's digits shows
as a gap between the one-field-at-a-time row and the others.
"""

from __future__ import annotations

import argparse
import json
import random

import httpx
from common import start_server

MODEL = "SmolLM2-135M-Instruct"
NAMES = ["Tom", "Ann", "Mia", "Carl", "Lena", "Omar", "Sara", "Ivan", "Yuki", "Paul"]
SYSTEM = "Extract the facts from the user's sentence."


def schema(fields: list[str]) -> dict:
    types = {"name": {"type": "string"}, "age": {"type": "integer"}, "cats": {"type": "integer"}}
    return {"type": "object", "properties": {f: types[f] for f in fields}, "required": fields}


def ask(url: str, fact: str, fields: list[str], tool: bool) -> dict:
    body: dict = {"model": MODEL, "temperature": 0, "max_tokens": 60,
                  "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": fact}]}
    if tool:
        body |= {"tools": [{"type": "function", "function": {"name": "save_person", "parameters": schema(fields)}}],
                 "tool_choice": "required"}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "facts", "schema": schema(fields)}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    message = r.json()["choices"][0]["message"]
    return json.loads(message["tool_calls"][0]["function"]["arguments"] if tool else message["content"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--facts", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    facts = [(NAMES[i % len(NAMES)], rng.randint(2, 90), rng.randint(1, 9)) for i in range(args.facts)]
    server, url, _ = start_server()
    try:
        ways = {"one field at a time": [["age"], ["cats"]], "fields [age, cats, name]": [["age", "cats", "name"]],
                "fields [name, age, cats]": [["name", "age", "cats"]]}
        print(f"{args.facts} facts 'NAME is AGE years old and has CATS cats.', temperature 0, {MODEL}")
        for tool in (False, True):
            for way, groups in ways.items():
                kept = {"not last": [0, 0], "last": [0, 0]}
                for name, age, cats in facts:
                    fact = f"{name} is {age} years old and has {cats} cats."
                    for fields in groups:
                        got = ask(url, fact, fields, tool)
                        for field, want in (("age", age), ("cats", cats)):
                            if field in fields:
                                where = "last" if fields[-1] == field else "not last"
                                kept[where][0] += got.get(field) == want
                                kept[where][1] += 1
                label = ("required tool, " if tool else "json_schema, ") + way
                cells = "  ".join(f"{k}: {a}/{n}" for k, (a, n) in kept.items() if n)
                print(f"  {label:45s} numbers kept  {cells}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
