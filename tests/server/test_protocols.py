"""Every API family's request and response shapes and stream framing, against a real server on
the tiny model (golden shapes per the seeds and spec/mindie-api.md)."""

import json

import httpx
import pytest

SEEDED = {"temperature": 0.9, "top_k": 20, "seed": 1234}


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse_events(response: httpx.Response, prefix: str = "data: ") -> list:
    text = response.text
    assert text.endswith("\n\n")
    chunks = text[:-2].split("\n\n")
    assert all(c.startswith(prefix) for c in chunks), chunks[:3]
    return [c[len(prefix):] for c in chunks]


def test_infer_non_stream_with_details(tiny_server):
    r = post(tiny_server, "/infer", {"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True,
                                                                        "do_sample": False}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"generated_text", "details"}
    d = body["details"]
    assert d["finish_reason"] in ("length", "eos_token")
    assert d["generated_tokens"] == len(d["generated_token_ids"]) <= 5
    assert isinstance(d["seed"], int)


def test_infer_stream_framing_and_final_event(tiny_server):
    body = {"inputs": "hello", "stream": True, "parameters": {"max_new_tokens": 6, **SEEDED, "details": True}}
    r = post(tiny_server, "/infer", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse_events(r)]
    assert events[0]["prefill_time"] is not None and events[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] is not None for e in events[1:])
    assert all(isinstance(e["token"]["id"], int) for e in events)  # seed 000: one integer id
    last = events[-1]
    assert last["token"]["text"] is None and last["details"]["generated_tokens"] == len(events)
    # the same seed without streaming gives the same text
    full = post(tiny_server, "/infer", {**body, "stream": False}).json()["generated_text"]
    assert last["generated_text"] == full
    assert "".join(e["token"]["text"] for e in events[:-1]) == full[: len("".join(e["token"]["text"]
                                                                                  for e in events[:-1]))]


def test_infer_token_takes_ids(tiny_server):
    r = post(tiny_server, "/infer_token", {"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 3,
                                                                                   "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] <= 3
    conflict = post(tiny_server, "/infer", {"input_id": [5], "inputs": "x"})
    assert conflict.status_code == 422 and "conflict" in conflict.json()["error"]


def test_tgi_generate_details_and_stream(tiny_server):
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "details": True, "decoder_input_details": True,
                                            **SEEDED, "top_p": None, "watermark": None}}
    r = post(tiny_server, "/generate", body)
    assert r.status_code == 200, r.text
    d = r.json()["details"]
    assert d["prompt_tokens"] == len(d["prefill"]) > 0
    assert len(d["tokens"]) == d["generated_tokens"]
    assert all(isinstance(t["id"], int) and isinstance(t["logprob"], float) and isinstance(t["special"], bool)
               for t in d["tokens"])
    body["parameters"]["decoder_input_details"] = False
    s = post(tiny_server, "/generate_stream", body)
    events = [json.loads(e) for e in sse_events(s)]
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == r.json()["generated_text"]
    assert events[-1]["details"]["finish_reason"] == d["finish_reason"]
    bad = post(tiny_server, "/generate_stream", {"inputs": "abc", "parameters": {"decoder_input_details": True}})
    assert bad.status_code == 422 and "decoder_input_details" in bad.json()["error"]


def test_tgi_root_wraps_in_a_list(tiny_server):
    r = post(tiny_server, "/", {"inputs": "abc", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and isinstance(r.json(), list) and "generated_text" in r.json()[0]
    s = post(tiny_server, "/", {"inputs": "abc", "stream": True, "parameters": {"max_new_tokens": 2}})
    assert sse_events(s)
    bad = post(tiny_server, "/", {"inputs": "abc", "stream": "yes"})
    assert bad.status_code == 422 and "stream" in bad.json()["error"]


def test_vllm_generate_text_and_nul_framing(tiny_server):
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0.8, "seed": 7}
    r = post(tiny_server, "/generate", body)
    assert r.status_code == 200, r.text
    [text] = r.json()["text"]
    assert text.startswith("abc ")
    s = post(tiny_server, "/generate", {**body, "stream": True})
    raw = s.text
    assert raw.endswith("\0") and "data:" not in raw
    deltas = [json.loads(c)["text"][0] for c in raw[:-1].split("\0")]
    assert "abc " + "".join(deltas) == text
    neither = post(tiny_server, "/generate", {"foo": 1})
    assert neither.status_code == 422 and "inputs" in neither.json()["error"]


def test_triton_text_and_token_routes(tiny_server):
    base = "/v2/models/tiny"
    r = post(tiny_server, base + "/generate", {"id": "abc_1", "text_input": "hi",
                                               "parameters": {"max_new_tokens": 3, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "abc_1" and body["model_name"] == "tiny" and body["model_version"] is None
    assert len(body["details"]["batch_size"]) == body["details"]["generated_tokens"]
    s = post(tiny_server, base + "/generate_stream", {"text_input": "hi", "parameters": {"max_new_tokens": 3}})
    events = [json.loads(e) for e in sse_events(s, prefix="data:")]
    assert not s.text.startswith("data: ")
    assert "finish_reason" in events[-1]["details"]
    t = post(tiny_server, base + "/infer", {"inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                                        "data": [3, 4, 5]}],
                                            "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 4}})
    assert t.status_code == 200, t.text
    out = t.json()["outputs"][0]
    assert out["datatype"] == "UINT32" and out["shape"] == [1, len(out["data"])] and 0 < len(out["data"]) <= 4
    mismatch = post(tiny_server, base + "/infer", {"inputs": [{"name": "input0", "shape": [4], "datatype": "UINT32",
                                                               "data": [3]}]})
    assert mismatch.status_code == 422 and "shape" in mismatch.json()["error"]
    assert post(tiny_server, "/v2/models/other/generate", {"text_input": "hi"}).status_code == 404


def test_openai_chat_stream_framing_and_usage(tiny_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            **SEEDED, "stream": True, "stream_options": {"include_usage": True}}
    s = post(tiny_server, "/v1/chat/completions", body)
    events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 5
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    full = post(tiny_server, "/v1/chat/completions", {**body, "stream": False}).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == streamed


def test_openai_completions_shapes(tiny_server):
    body = {"model": "tiny", "prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, **SEEDED, "logprobs": 2,
            "echo": False}
    r = post(tiny_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    # seed 002: the top 2, plus the sampled token when it is not among them
    assert all(len(top) <= 3 and tok in top and top[tok] == v
               for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    assert any(len(top) == 3 for c in out["choices"] for top in c["logprobs"]["top_logprobs"]) or all(
        len(top) == 2 for c in out["choices"] for top in c["logprobs"]["top_logprobs"])
    u = out["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert len(u["batch_size"]) == len(u["queue_wait_time"]) > 0
    ids = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                                "echo": True, "temperature": 0})
    assert ids.status_code == 200, ids.text
    s = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 3, **SEEDED,
                                              "stream": True})
    events = sse_events(s)
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    same = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 3, **SEEDED})
    assert same.json()["choices"][0]["text"] == text


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/tiny", "/v2", "/v2/models/tiny",
                                  "/v2/models/tiny/config", "/tokenizer_info", "/openapi.json"])
def test_business_queries(tiny_server, path):
    r = httpx.get(tiny_server.url + path)
    assert r.status_code == 200, r.text
    if path == "/v1/models":
        [card] = r.json()["data"]
        assert {"id", "object", "created", "owned_by"} <= set(card) and card["id"] == "tiny"


def test_tokenizer_routes(tiny_server):
    r = post(tiny_server, "/v1/tokenizer", {"inputs": "hello"}).json()
    assert r["token_number"] == len(r["tokens"]) > 0
    t = post(tiny_server, "/tokenize", {"prompt": "hello"}).json()
    assert t["count"] == len(t["tokens"])
    d = post(tiny_server, "/detokenize", {"tokens": t["tokens"]}).json()
    assert d["prompt"].endswith("hello") and d["content"] == d["prompt"]


def test_tokenize_in_llamacpp_and_vllm_shapes(tiny_server):
    vllm = post(tiny_server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    plain = post(tiny_server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()
    llama = post(tiny_server, "/tokenize", {"content": "hello world"}).json()  # llama.cpp: no specials by default
    assert llama["tokens"] == plain["tokens"]
    assert post(tiny_server, "/tokenize", {"content": "hello world", "add_special": True}).json()["tokens"] == \
        vllm["tokens"]
    pieces = post(tiny_server, "/tokenize", {"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain["tokens"] and "".join(p["piece"] for p in pieces) == "hello world"
    assert len(vllm["token_strs"]) == len(vllm["tokens"]) and all(isinstance(s, str) for s in vllm["token_strs"])
    assert post(tiny_server, "/detokenize", {"tokens": plain["tokens"]}).json()["content"] == "hello world"
    both = post(tiny_server, "/tokenize", {"prompt": "a", "content": "b"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


def test_tokenizer_info_names_the_special_tokens(tiny_server):
    info = httpx.get(tiny_server.url + "/tokenizer_info").json()
    eos = info["eos_token_id"]
    assert eos == info["eos_token_ids"][0]
    assert post(tiny_server, "/detokenize", {"tokens": [eos]}).json()["prompt"] == info["eos_token"]
    assert {"bos_token", "bos_token_id", "pad_token", "pad_token_id"} <= set(info)
    if info["bos_token_id"] is not None:
        assert post(tiny_server, "/detokenize", {"tokens": [info["bos_token_id"]]}).json()["prompt"] == \
            info["bos_token"]


@pytest.mark.parametrize("path", ["/metrics", "/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready"])
def test_metrics_and_kserve_health_on_the_business_port(tiny_server, path):
    r = httpx.get(tiny_server.url + path, timeout=30)
    assert r.status_code == 200, r.text
    if path == "/metrics":  # the metrics plane's families, under the same names
        def families(text: str) -> list[str]:
            return [line for line in text.splitlines() if line.startswith("# TYPE")]
        assert families(r.text) == families(httpx.get(tiny_server.metrics_url + path).text)
        assert any("request_success_total" in f for f in families(r.text))
    assert httpx.get(tiny_server.url + "/v2/models/other/ready").status_code == 404


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/infer", "/generate", "/tokenize",
                                   "/v2/models/tiny/generate"])
@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; b=x"])
def test_non_json_bodies_are_415(tiny_server, route, ctype):
    """The types a browser may POST cross-site without a preflight never reach the engine."""
    body = json.dumps({"model": "tiny", "prompt": "hi", "inputs": "hi", "text_input": "hi",
                       "messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(tiny_server.url + route, content=body, headers={"Content-Type": ctype}, timeout=30)
    assert r.status_code == 415, r.text
    assert "application/json" in json.dumps(r.json())
    ok = httpx.post(tiny_server.url + route, content=body, headers={"Content-Type": "application/json; charset=utf-8"},
                    timeout=30)
    assert ok.status_code != 415


def test_triton_binary_tensors_are_a_400_that_says_to_use_json(tiny_server):
    header = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64",
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    r = httpx.post(tiny_server.url + "/v2/models/tiny/infer", content=header + bytes(16), timeout=30,
                   headers={"Inference-Header-Content-Length": str(len(header)),
                            "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "binary_data=False" in r.json()["error"]


@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready",
                                  "/info", "/v2/models/tiny/getSlotCount", "/metrics-json", "/v1/config",
                                  "/v1/status", "/v2/status", "/health/timed-5"])
def test_management_routes(tiny_server, path):
    r = httpx.get(tiny_server.management_url + path, timeout=30)
    assert r.status_code == 200, r.text


def test_metrics_plane_uses_mindie_names(tiny_server):
    post(tiny_server, "/infer", {"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    text = httpx.get(tiny_server.metrics_url + "/metrics").text
    for name in ("request_received_total", "request_success_total", "num_requests_running", "npu_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_count", "num_preemptions_total",
                 "request_generation_tokens_bucket"):
        assert name in text, name
    assert 'model_name="tiny"' in text


def test_request_id_is_echoed(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/models", headers={"X-Request-Id": "abc123"})
    assert r.headers["x-request-id"] == "abc123"
    assert httpx.get(tiny_server.url + "/v1/models").headers["x-request-id"]


def test_cors_preflight_is_answered(tiny_server):
    r = httpx.options(tiny_server.url + "/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")


def test_completions_beam_search(tiny_server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "n": 2, "best_of": 3, "use_beam_search": True,
            "temperature": 0, "length_penalty": 1.0}
    r = post(tiny_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] != choices[1]["text"]
    s = post(tiny_server, "/v1/completions", {**body, "stream": True})
    events = [json.loads(e) for e in sse_events(s)[:-1]]
    streamed = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {c["index"]: c["text"] for c in choices}
    bad = post(tiny_server, "/v1/completions", {**body, "stop": ["x"]})
    assert bad.status_code == 400 and "stop" in bad.json()["error"]["message"]


def test_completions_echo_logprobs_scores_the_prompt(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True,
                                              "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    more = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 2,
                                                 "echo": True, "logprobs": 0, "temperature": 0}).json()
    assert more["choices"][0]["logprobs"]["token_logprobs"][1:4] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    assert len(more["choices"][0]["logprobs"]["tokens"]) == 6
    assert post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}).status_code == 400


def test_chat_template_from_the_request_gets_the_special_tokens(tiny_server):
    def prompt_tokens(template):
        r = post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1, "chat_template": template})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert plain == 4  # "[hi]", one token per byte
    assert prompt_tokens("{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}") == plain + 1
