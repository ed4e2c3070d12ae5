"""Bad input gets a clear error naming the field and its range, in each family's error shape."""

import httpx
import pytest


def post(server, path, body=None, content=None, **kw):
    if content is not None:
        return httpx.post(server.url + path, content=content, timeout=30, **kw)
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


@pytest.mark.parametrize("params, field, rng", [
    ({"temperature": 0}, "parameters.temperature", "(0, inf)"),
    ({"top_p": 1.0}, "parameters.top_p", "(0, 1)"),
    ({"top_k": 0}, "parameters.top_k", "(0, 2147483647]"),
    ({"priority": 6}, "parameters.priority", "[1, 5]"),
    ({"timeout": 0}, "parameters.timeout", "[1, 3600]"),
    ({"timeout": 3601}, "parameters.timeout", "[1, 3600]"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens", "(0, 2147483647]"),
    ({"seed": -1}, "parameters.seed", "[0, 18446744073709551615]"),
    ({"seed": 2**64}, "parameters.seed", "[0, 18446744073709551615]"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty", "(0, inf)"),
])
def test_native_ranges(tiny_server, params, field, rng):
    r = post(tiny_server, "/infer", {"inputs": "x", "parameters": params})
    assert r.status_code == 422
    body = r.json()
    assert body["error_type"] == "Input Validation Error"
    assert field in body["error"] and rng in body["error"], body


@pytest.mark.parametrize("body, field", [
    ({"inputs": 5}, "inputs"),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, "parameters.temperature"),
    ({"inputs": "x", "parameters": {"top_k": 2.5}}, "parameters.top_k"),
    ({"inputs": "x", "parameters": {"details": 1}}, "parameters.details"),
    ({"inputs": "x", "stream": "true"}, "stream"),
    # an image part on this text-only model: a 400 naming the model (tests/server/test_vision_routes.py)
    ({"inputs": ""}, "inputs"),
    ({"input_id": [10**9]}, "input_id"),
])
def test_native_types_and_content(tiny_server, body, field):
    r = post(tiny_server, "/infer", body)
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]


def test_nulls_mean_unset_and_unknown_fields_are_ignored(tiny_server):
    r = post(tiny_server, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2, "temperature": None,
                                                                      "top_k": None, "stop": None, "seed": None,
                                                                      "best_of": None, "unknown": 1}, "extra": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b'{"inputs": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
                                     b"null", b"[]", b'"text"'])
def test_malformed_bodies(tiny_server, content):
    r = post(tiny_server, "/infer", content=content)
    assert r.status_code == 422, r.text
    assert r.json()["error"]
    o = post(tiny_server, "/v1/chat/completions", content=content)
    assert o.status_code == 400 and o.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": -1}, "temperature", "[0, 2]"),  # seed 004's chat ranges
    ({"temperature": 2.5}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "-1 or [0, 2147483647]"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "non-empty"),
    ({"messages": [{"role": "assistant", "content": ""}]}, "messages[0].content", "non-empty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}]},
     "tools[0].function.parameters.properties", "mapping each parameter name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                               "required": "a"}}}]},
     "tools[0].function.parameters.required", "list of parameter names"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}}}]},
     "tools[0].function.parameters.required", "not in properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": [], "additionalProperties": "no"}}}]},
     "tools[0].function.parameters.additionalProperties", "a schema object"),
    ({"stop": ["x"] * 1025}, "stop", "at most 1024"),
    ({"stop": "x" * 1025}, "stop", "at most 1024"),
    ({"stop": ["x" * 1000] * 33}, "stop", "32768"),
    ({"messages": [{"role": "user", "content": "x" * (4 * 2**20 + 1)}]}, "messages", "4 MB"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty", "(0, 2]"),
    ({"n": 0}, "n", "[1, 128]"),
    ({"n": 2, "best_of": 1}, "best_of", "n=2"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"stop": [""]}, "stop", "at least 1"),
    ({"max_tokens": 0}, "max_tokens", "(0, 2147483647]"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "system"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id", "required"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "required"),
])
def test_openai_chat_errors(tiny_server, body, param, words):
    full = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = post(tiny_server, "/v1/chat/completions", full)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] is None  # a string or null (openai-python)
    assert param in err["message"] and words in err["message"], err


def test_openai_model_must_be_served(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_prompt_over_the_limit_names_both_numbers(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5] * 450, "max_tokens": 2})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "maxInputTokenLen=400" in msg and "maxSeqLen-1=511" in msg


def test_body_over_max_request_length_is_413(tiny_server):
    limit = tiny_server.settings.max_request_bytes
    r = httpx.post(tiny_server.url + "/infer", content=b"x" * (limit + 1), timeout=30)
    assert r.status_code == 413
    chunked = httpx.post(tiny_server.url + "/infer", content=iter([b"x" * 2**20] * (limit // 2**20 + 2)),
                         timeout=30)
    assert chunked.status_code == 413


def test_error_bodies_carry_no_internals(tiny_server):
    r = post(tiny_server, "/infer", {"inputs": "x", "parameters": {"temperature": "<object at 0x7f>"}})
    assert "Traceback" not in r.text and "/work" not in r.text


def test_oversized_request_head_is_431(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/models", headers={"X-Big": "a" * 100_000})
    assert r.status_code == 431 and "headers too large" in r.json()["error"]
    assert httpx.get(tiny_server.url + "/v1/models", headers={"X-Ok": "a" * 8000}).status_code == 200
