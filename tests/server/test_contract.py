"""The seeds' contract, field by field (issue 10), against a real server on the tiny model. A
test relies on a seeded output being the same twice, never on what that output is."""

import json
import re

import httpx
import pytest

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse_json(response: httpx.Response) -> list:
    chunks = response.text[:-2].split("\n\n")
    assert chunks[-1] == "data: [DONE]"
    return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_uint64_seeds_on_every_family(tiny_server, seed):
    for path, body in [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 4, "seed": seed}),
        ("/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 4, "seed": seed}),
        ("/infer", {"inputs": "ab", "parameters": {"max_new_tokens": 4, "seed": seed, "do_sample": True}}),
        ("/generate", {"prompt": "ab", "max_tokens": 4, "seed": seed}),
    ]:
        first, again = post(tiny_server, path, body), post(tiny_server, path, body)
        assert first.status_code == 200, (path, first.text)
        assert first.json().get("choices", first.json()) == again.json().get("choices", again.json())


def test_usage_waits_and_batch_sizes_per_token(tiny_server):
    out = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 6,
                                                "ignore_eos": True, "temperature": 0}).json()
    u = out["usage"]
    assert len(u["queue_wait_time"]) == len(u["batch_size"]) == u["completion_tokens"] == 6
    assert all(isinstance(w, int) and w >= 0 for w in u["queue_wait_time"])
    assert u["prompt_tokens_details"] == {"cached_tokens": 0} or u["prompt_tokens_details"]["cached_tokens"] >= 0


def test_completions_sampling_rules(tiny_server):
    base = {"model": "tiny", "prompt": "ab", "max_tokens": 6, "ignore_eos": True}
    r = post(tiny_server, "/v1/completions", {**base, "best_of": 2, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    # temperature 0 is greedy: penalties do not change it
    plain = post(tiny_server, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    penalised = post(tiny_server, "/v1/completions", {**base, "temperature": 0, "repetition_penalty": 1.9,
                                                      "presence_penalty": 2, "frequency_penalty": -2}).json()
    assert penalised["choices"][0]["text"] == plain
    # beam search: best_of below n is not refused; the stream is one event with every choice
    beam = {**base, "use_beam_search": True, "n": 2, "best_of": 1}
    whole = post(tiny_server, "/v1/completions", beam)
    assert whole.status_code == 200, whole.text
    events = sse_json(post(tiny_server, "/v1/completions", {**beam, "stream": True}))
    assert len(events) == 1 and [c["index"] for c in events[0]["choices"]] == [0, 1]
    assert [c["text"] for c in events[0]["choices"]] == [c["text"] for c in whole.json()["choices"]]
    assert all(c["finish_reason"] for c in events[0]["choices"])


def test_stop_limits(tiny_server):
    base = {"model": "tiny", "prompt": "ab", "max_tokens": 2}
    assert post(tiny_server, "/v1/completions", {**base, "stop": "x" * 32768}).status_code == 200
    too_long = post(tiny_server, "/v1/completions", {**base, "stop": "x" * 32769})
    assert too_long.status_code == 400 and "32768" in too_long.json()["error"]["message"]
    many = [f"never{i}" for i in range(1024)]
    assert post(tiny_server, "/v1/completions", {**base, "stop": many}).status_code == 200
    assert post(tiny_server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "stop": many}).status_code == 200
    # stop_token_ids outside the vocabulary are refused, naming the id and the vocabulary's size
    first = post(tiny_server, "/v1/completions", {**base, "stop_token_ids": [-5]}).json()["error"]["message"]
    vocab = int(re.search(r"\[0, (\d+)\)", first).group(1))  # the model's (its logits' width)
    assert vocab >= httpx.get(tiny_server.url + "/tokenizer_info").json()["vocab_size"]
    for bad in (-5, vocab, 2**40):
        r = post(tiny_server, "/v1/completions", {**base, "stop_token_ids": [3, bad]})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and str(bad) in msg and f"[0, {vocab})" in msg, r.text
        assert r.json()["error"]["param"] == "stop_token_ids"
    assert post(tiny_server, "/v1/completions", {**base, "stop_token_ids": [vocab - 1]}).status_code == 200


def test_logit_bias_moves_the_choice(tiny_server):
    base = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = post(tiny_server, "/v1/completions", base).json()["choices"][0]["token_ids"]
    forced = post(tiny_server, "/v1/completions", {**base, "logit_bias": {"7": 100}}).json()["choices"][0]
    assert forced["token_ids"] == [7, 7, 7, 7]
    banned = post(tiny_server, "/v1/completions", {**base, "logit_bias": {str(free[0]): -100}}).json()
    assert banned["choices"][0]["token_ids"][0] != free[0]
    chat = post(tiny_server, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                     "logit_bias": {"9": 100}, "logprobs": True}).json()
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == [
        post(tiny_server, "/detokenize", {"tokens": [9]}).json()["prompt"]] * 3
    vocab = httpx.get(tiny_server.url + "/tokenizer_info").json()["vocab_size"]
    vocab = int(re.search(r"\[0, (\d+)\)", post(tiny_server, "/v1/completions", {**base, "logit_bias": {
        str(10**6): 1}}).json()["error"]["message"]).group(1))
    for key, words in ((str(vocab), f"[0, {vocab})"), ("-1", f"[0, {vocab})"), ("x", "not a token id"),
                       ("5", "[-100, 100]")):
        r = post(tiny_server, "/v1/completions", {**base, "logit_bias": {key: 101 if key == "5" else 1}})
        assert r.status_code == 400 and words in r.json()["error"]["message"] and key in r.json()["error"]["message"]


def test_chat_stream_framing(tiny_server):
    body = {**CHAT, "max_tokens": 5, "temperature": 0.9, "seed": 3, "n": 2, "stream": True}
    chunks = sse_json(post(tiny_server, "/v1/chat/completions", body))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert all(c["delta"]["role"] == "assistant" for c in mine[:-1])
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] in ("stop", "length")
    assert not any("usage" in c for c in chunks)  # only with stream_options.include_usage
    asked = sse_json(post(tiny_server, "/v1/chat/completions", {**body, "ignore_eos": True,
                                                                 "stream_options": {"include_usage": True}}))
    assert [c for c in asked if "usage" in c] == [asked[-1]] and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert asked[-1]["usage"]["completion_tokens"] == 2 * 5  # n = 2, max_tokens = 5


def test_continuous_usage_stats(tiny_server):
    body = {**CHAT, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_json(post(tiny_server, "/v1/chat/completions", body))
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and chunks[-1]["choices"] == []
    comp = sse_json(post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 3,
                                                          "stream": True,
                                                          "stream_options": {"continuous_usage_stats": True}}))
    assert all("usage" in c for c in comp)


def test_infer_stream_token_id_is_an_integer(tiny_server):
    r = post(tiny_server, "/infer", {"inputs": "ab", "stream": True, "parameters": {"max_new_tokens": 3}})
    events = [json.loads(c.removeprefix("data: ")) for c in r.text[:-2].split("\n\n")]
    assert all(isinstance(e["token"]["id"], int) for e in events)


def test_triton_stream_events_as_seed_003(tiny_server):
    r = post(tiny_server, "/v2/models/tiny/generate_stream",
             {"text_input": "hi", "parameters": {"max_new_tokens": 3, "details": True}})
    events = [json.loads(c.removeprefix("data:")) for c in r.text[:-2].split("\n\n")]
    for k, e in enumerate(events):
        assert {"id", "model_name", "model_version", "text_output", "details", "prefillTime", "decodeTime"} <= set(e)
        d = e["details"]
        assert {"generated_tokens", "first_token_cost", "decode_cost", "batch_size", "queue_wait_time"} <= set(d)
        assert d["generated_tokens"] == k + 1 and isinstance(d["queue_wait_time"], int)
        assert (e["prefillTime"] is not None) == (k == 0) and (e["decodeTime"] is not None) == (k > 0)
    assert "finish_reason" in events[-1]["details"]


def test_token_limit_names_all_four(tiny_server):
    r = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [5] * 401, "max_tokens": 1})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and all(k in msg for k in ("maxInputTokenLen", "maxSeqLen-1",
                                                            "max_position_embeddings", "1048576")), msg


def test_health_and_unknown_routes_on_the_business_plane(tiny_server):
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    r = httpx.get(tiny_server.url + "/v1/vector_stores/abc")
    assert r.status_code == 404 and r.json()["error"]["message"] and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(tiny_server.url + "/v1/nothing", json={})
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(tiny_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "pets": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog", "fish"]}, "name": {"type": "string"}},
        "required": ["kind"]}}}, "required": ["name", "age", "pets"]}


def test_structured_output_always_parses_within_max_tokens(smol_server):
    """A random model rambles: whatever it samples, the output closes in time and validates;
    a budget that forced the ending says "length"."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}

    def one(seed: int) -> None:
        body = {"model": smol_server.ctx.settings.model_name, "messages": CHAT["messages"], "max_tokens": 48,
                "temperature": 1.0, "seed": seed}
        body |= {"response_format": fmt} if seed % 2 else {"tools": [tool], "tool_choice": "required"}
        choice = post(smol_server, "/v1/chat/completions", body).json()["choices"][0]
        if seed % 2:
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        else:
            call = choice["message"]["tool_calls"][0]["function"]
            assert call["name"] == "get_weather"
            jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(100)))
    too_few = post(smol_server, "/v1/chat/completions", {"model": smol_server.ctx.settings.model_name,
                                                         "messages": CHAT["messages"], "max_tokens": 3,
                                                         "response_format": fmt})
    assert too_few.status_code == 400 and "needs at least" in too_few.json()["error"]["message"]


def test_return_token_ids(tiny_server):
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = post(tiny_server, "/v1/completions", base).json()["choices"][0]
    assert whole["prompt_token_ids"] == post(tiny_server, "/tokenize", {"prompt": "hello"}).json()["tokens"]
    assert post(tiny_server, "/detokenize", {"tokens": whole["token_ids"]}).json()["prompt"] == whole["text"]
    chunks = sse_json(post(tiny_server, "/v1/completions", {**base, "stream": True}))
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks if "prompt_token_ids" in c["choices"][0]] == [
        whole["prompt_token_ids"]]
    chat = {**CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    body = post(tiny_server, "/v1/chat/completions", chat).json()
    assert body["prompt_token_ids"] == post(tiny_server, "/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
    ids = body["choices"][0]["token_ids"]
    assert post(tiny_server, "/detokenize", {"tokens": ids}).json()["prompt"] == body["choices"][0]["message"][
        "content"]
    chunks = sse_json(post(tiny_server, "/v1/chat/completions", {**chat, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == body["prompt_token_ids"]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])] == ids


def test_prompt_logprobs_agree_with_echo_scoring(tiny_server):
    base = {"model": "tiny", "prompt": "hello there", "max_tokens": 1, "temperature": 0}
    scored = post(tiny_server, "/v1/completions", {**base, "echo": True, "logprobs": 2}).json()["choices"][0]
    vllm = post(tiny_server, "/v1/completions", {**base, "prompt_logprobs": 2, "return_token_ids": True}).json()
    choice = vllm["choices"][0]
    entries, ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
    assert entries[0] is None and len(entries) == len(ids)
    for k, (entry, token) in enumerate(zip(entries[1:], ids[1:]), 1):
        assert entry[str(token)]["logprob"] == pytest.approx(scored["logprobs"]["token_logprobs"][k], abs=1e-5)
        top = sorted((v for t, v in entry.items() if v["rank"] is not None), key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == list(range(1, len(top) + 1)) and len(top) == 2
        assert top[0]["logprob"] >= top[1]["logprob"] >= entry[str(token)]["logprob"] or entry[str(token)]["rank"]
    chat = post(tiny_server, "/v1/chat/completions", {**CHAT, "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    r = post(tiny_server, "/v1/completions", {**base, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_continue_final_message_and_echo(tiny_server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    cont = post(tiny_server, "/v1/chat/completions", {**body, "continue_final_message": True,
                                                      "add_generation_prompt": False, "echo": True}).json()
    whole = post(tiny_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    prompt = cont["prompt_token_ids"]
    assert whole[: len(prompt)] == prompt  # the same rendering, up to the final message's text
    assert post(tiny_server, "/detokenize", {"tokens": prompt}).json()["prompt"].endswith("The answer is")
    same = post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True}).json()
    assert cont["choices"][0]["message"]["content"] == "The answer is" + same["choices"][0]["text"]
    chunks = sse_json(post(tiny_server, "/v1/chat/completions", {**body, "continue_final_message": True,
                                                                 "add_generation_prompt": False, "echo": True,
                                                                 "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        cont["choices"][0]["message"]["content"]
    both = post(tiny_server, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_server):
    info = httpx.get(tiny_server.url + "/tokenizer_info").json()
    eos = info["eos_token_id"]
    base = {"model": "tiny", "prompt": "ab", "max_tokens": 10, "temperature": 0, "return_token_ids": True,
            "logit_bias": {str(eos): 100}}
    assert post(tiny_server, "/v1/completions", base).json()["choices"][0]["token_ids"] == [eos]
    held = post(tiny_server, "/v1/completions", {**base, "min_tokens": 3}).json()["choices"][0]
    assert len(held["token_ids"]) == 4 and held["token_ids"][3] == eos and eos not in held["token_ids"][:3]
    assert held["finish_reason"] == "stop"
    stop_id = post(tiny_server, "/v1/completions", {**base, "logit_bias": {"9": 100}, "stop_token_ids": [9],
                                                    "min_tokens": 2}).json()["choices"][0]
    assert 9 not in stop_id["token_ids"][:2] and stop_id["token_ids"][2] == 9
    r = post(tiny_server, "/v1/completions", {**base, "min_tokens": 11})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value, neutral", [("min_p", 0.1, 0.0), ("typical_p", 0.5, 1.0),
                                                   ("bad_words", ["x"], []), ("reasoning_effort", "high", None),
                                                   ("modalities", ["text", "audio"], ["text"])])
def test_fields_that_would_change_the_output_are_refused_not_dropped(tiny_server, field, value, neutral):
    r = post(tiny_server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(tiny_server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, field: neutral}).status_code == 200
