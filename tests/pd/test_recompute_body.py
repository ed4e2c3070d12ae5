"""The retry: body a decode node builds when it preempts a request, and what a prefill node reads
back from it: MindIE's "N,p1..pN,o1..oM" in each family's input field, plus our continuation."""

from __future__ import annotations

import json

import pytest

from mindie.engine.request import RequestOutput
from mindie.pd.recompute import CONTINUATION_KEY, RecomputeError, parse_ids_input, read_retry, retry_body
from mindie.server.results import StreamItem

PROMPT = [11, 12, 13]


def item(tokens: list[int], text: str) -> StreamItem:
    out = RequestOutput(request_id="7", index=0, new_token_ids=tokens, new_text=text, new_logprobs=[],
                        finish_reason=None, num_prompt_tokens=3, num_output_tokens=len(tokens),
                        cumulative_logprob=-1.5, seed=42, batch_sizes=[1], queue_waits_s=[0.0],
                        first_token_latency_s=None)
    return StreamItem(out, None, 1.0)


ITEMS = [item([21], "a"), item([22], "b"), item([23], "c")]
BODIES = {
    "/infer": ({"inputs": "hello", "stream": True}, ("inputs",)),
    "/infer_token": ({"input_id": [1, 2], "parameters": {}}, ("inputs",)),
    "/generate": ({"prompt": "the cat", "max_tokens": 5}, ("prompt",)),
    "/generate_stream": ({"inputs": "abc"}, ("inputs",)),
    "/": ({"inputs": "abc", "stream": False}, ("inputs",)),
    "/v1/chat/completions": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ("messages",)),
    "/v1/completions": ({"model": "m", "prompt": "once"}, ("prompt",)),
    "/v2/models/{model}/generate": ({"text_input": "hi"}, ("text_input",)),
    "/v2/models/{model}/generate_stream": ({"text_input": "hi"}, ("text_input",)),
    "/v2/models/{model}/infer": ({"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32",
                                              "data": [1, 2]}]}, ("inputs", 0, "data")),
}


@pytest.mark.parametrize("template", BODIES)
def test_every_family_puts_the_ids_in_its_input_field_and_reads_them_back(template):
    original, path = BODIES[template]
    raw = retry_body(template, json.dumps(original), PROMPT, ITEMS, {"created": 5})
    sent = json.loads(raw)
    field = sent
    for key in path:
        field = field[key]
    assert field == "3,11,12,13,21,22,23"  # N, the prompt ids, the outputs so far
    assert "input_id" not in sent  # /infer_token: the recompute input replaces the ids
    back = read_retry(template, raw)
    assert json.loads(back.body) == original and back.prompt == PROMPT and back.outputs == [21, 22, 23]
    assert back.renderer_state == {"created": 5} and back.items == ITEMS


@pytest.mark.parametrize("text, needle", [
    ("3,1,2", "must leave at least one prompt and one output id"),
    ("0,1,2", "must leave at least one prompt"),
    ("2,1,x,3", "comma-separated integers"),
    ("1,-1,2", "non-negative"),
    ("", "comma-separated integers"),
])
def test_a_bad_ids_input_is_named(text, needle):
    with pytest.raises(RecomputeError, match=needle):
        parse_ids_input(text)


def test_outputs_must_agree_with_the_items_and_the_continuation_must_be_there():
    raw = json.loads(retry_body("/infer", json.dumps({"inputs": "x"}), PROMPT, ITEMS, {}))
    raw["inputs"] = "3,11,12,13,21,22,99"
    with pytest.raises(RecomputeError, match="differ from the tokens"):
        read_retry("/infer", json.dumps(raw).encode())
    del raw[CONTINUATION_KEY]
    with pytest.raises(RecomputeError, match="needs the mindieContinuation field"):
        read_retry("/infer", json.dumps(raw).encode())
    with pytest.raises(RecomputeError, match="not JSON"):
        read_retry("/infer", b"{")
    with pytest.raises(RecomputeError, match="not a generation route"):
        empty = {CONTINUATION_KEY: {"body": "{}", "items": [], "rendererState": {}}}
        read_retry("/metrics", json.dumps(empty).encode())
