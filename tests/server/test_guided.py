"""Structured output asked for the way vLLM, llama.cpp and TGI clients ask for it: every
vocabulary constrains the output (it matches what was asked, on the tiny random model, whose free
output never would), one constraint at a time, and a bad one is a 400 naming its field."""

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}
GBNF = 'root ::= "yes" | "no" | "maybe"'
COMPLETIONS = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, "temperature": 0}


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(path: str, body: dict) -> str:
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if path == "/v1/completions":
        return body["choices"][0]["text"]
    return body["text"][0].removeprefix("hello ")  # vLLM /generate: the prompt, a space, the output


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) is not None
    return text in ("yes", "no", "maybe")


FIELDS = [
    ("json", {"guided_json": SCHEMA}),
    ("json", {"guided_json": json.dumps(SCHEMA)}),
    ("json", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}),
    ("json", {"json_schema": SCHEMA}),  # llama.cpp
    ("regex", {"guided_regex": "[0-9]{3}-[a-z]{2}"}),
    ("regex", {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}),
    ("choice", {"guided_choice": ["yes", "no", "maybe"]}),
    ("choice", {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("choice", {"guided_grammar": GBNF}),
    ("choice", {"grammar": GBNF}),  # llama.cpp's GBNF
    ("choice", {"grammar": 'start: "yes" | "no" | "maybe"'}),  # Lark
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
@pytest.mark.parametrize("kind, fields", FIELDS)
def test_every_vocabulary_constrains_the_output(tiny_server, path, kind, fields):
    base = CHAT if path == "/v1/chat/completions" else {k: v for k, v in COMPLETIONS.items() if k != "model"} \
        if path == "/generate" else COMPLETIONS
    free = text_of(path, post(tiny_server, path, base))
    assert not valid(kind, free)  # the random model never writes it by itself
    assert valid(kind, text_of(path, post(tiny_server, path, {**base, **fields}))), fields


@pytest.mark.parametrize("response_format", [{"type": "json_object", "schema": SCHEMA},
                                             {"type": "json_object", "value": SCHEMA},
                                             {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}])
def test_response_format_with_the_schema_beside_the_type(tiny_server, response_format):
    body = post(tiny_server, "/v1/chat/completions", {**CHAT, "response_format": response_format})
    assert valid("json", text_of("/v1/chat/completions", body))


@pytest.mark.parametrize("grammar", [{"type": "json", "value": SCHEMA}, {"type": "json", "value": json.dumps(SCHEMA)},
                                     {"type": "json_schema", "value": {"name": "x", "schema": SCHEMA}},
                                     {"type": "regex", "value": "[0-9]{3}-[a-z]{2}"}])
def test_tgi_grammar(tiny_server, grammar):
    body = post(tiny_server, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 40,
                                                                            "grammar": grammar}})
    assert valid("regex" if grammar["type"] == "regex" else "json", body["generated_text"])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETIONS, "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/completions", {**COMPLETIONS, "guided_regex": "(a"}, "guided_regex"),
    ("/v1/completions", {**COMPLETIONS, "grammar": "root ::= ("}, "grammar"),
    ("/v1/completions", {**COMPLETIONS, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {**COMPLETIONS, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {**COMPLETIONS, "structured_outputs": {"structural_tag": "x"}},
     "structured_outputs.structural_tag"),
    ("/v1/completions", {**COMPLETIONS, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("/generate", {"inputs": "hello", "parameters": {"grammar": {"type": "regex", "value": 5}}},
     "parameters.grammar.value"),
])
def test_bad_or_competing_constraints_are_400(tiny_server, path, body, param):
    r = httpx.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code in (400, 422), r.text
    err = r.json()["error"]
    assert param in (err["message"] if isinstance(err, dict) else err), err


def test_tgi_best_of_and_top_n_tokens(tiny_server):
    params = {"max_new_tokens": 5, "details": True, "best_of": 3, "do_sample": True, "seed": 7, "top_n_tokens": 3}
    body = post(tiny_server, "/generate", {"inputs": "hello", "parameters": params})
    details = body["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2

    def total(d):
        return sum(t["logprob"] for t in d["tokens"])

    assert all(total(details) >= total(o) - 1e-4 for o in others)  # the likeliest is returned
    for d in (details, *others):
        assert len(d["top_tokens"]) == len(d["tokens"])
        for top in d["top_tokens"]:
            assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    stream = httpx.post(tiny_server.url + "/generate_stream", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 3, "top_n_tokens": 2}}, timeout=60)
    events = [json.loads(line[5:]) for line in stream.text.split("\n") if line.startswith("data:")]
    assert all(len(e["top_tokens"]) == 2 and e["top_tokens"][0]["logprob"] >= e["token"]["logprob"] - 1e-5
               for e in events)
    greedy = httpx.post(tiny_server.url + "/generate", json={"inputs": "hi", "parameters": {"best_of": 2}})
    assert greedy.status_code == 422 and "sampling" in greedy.json()["error"]


def test_completions_take_response_format(tiny_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    body = post(tiny_server, "/v1/completions", {**COMPLETIONS, "response_format": fmt})
    assert valid("json", text_of("/v1/completions", body))
    both = httpx.post(tiny_server.url + "/v1/completions", json={**COMPLETIONS, "response_format": fmt,
                                                                 "guided_regex": "a"}, timeout=60)
    assert both.status_code == 400 and "guided_regex" in both.json()["error"]["message"]
