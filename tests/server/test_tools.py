"""Tool calling and structured output with the embedded model: when a call or a schema is
required, every answer parses and validates."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                          "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
BOOKING = {"type": "function", "function": {"name": "book_table", "parameters": {
    "type": "object", "properties": {
        "restaurant": {"type": "string"},
        "party": {"type": "object", "properties": {"adults": {"type": "integer"}, "children": {"type": "integer"}},
                  "required": ["adults"]},
        "times": {"type": "array", "items": {"type": "string", "enum": ["18:00", "19:00", "20:00"]}, "minItems": 1,
                  "maxItems": 3}},
    "required": ["restaurant", "party", "times"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                     "exact": {"type": "boolean"}}, "required": ["query"]}}}
TOOLS = [WEATHER, BOOKING, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "Book a table at Luigi's for two adults at 7pm.",
             "Find recent papers about paged attention.", "Is it cold in Oslo today?", "Help me plan dinner."]


def chat(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 400, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _required_call(server, seed):
    tools = [TOOLS[seed % 3], TOOLS[(seed + 1) % 3]] if seed % 2 else TOOLS
    return chat(server, {"messages": [{"role": "user", "content": QUESTIONS[seed % len(QUESTIONS)]}],
                         "tools": tools, "tool_choice": "required", "temperature": 1.0, "seed": seed}), tools


def test_required_tool_calls_always_parse_and_validate(smol_server):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: _required_call(smol_server, s), range(50)))
    for body, tools in results:
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        name = call["function"]["name"]
        assert name in {t["function"]["name"] for t in tools}
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_named_function_is_the_one_called(smol_server):
    body = chat(smol_server, {"messages": [{"role": "user", "content": "Hello!"}], "tools": TOOLS, "seed": 1,
                              "tool_choice": {"type": "function", "function": {"name": "search"}}})
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "search"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["search"])


def test_json_schema_response_format_always_validates(smol_server):
    # Bounded strings: an unbounded one lets a sampling model ramble past max_tokens, and an output
    # cut off by max_tokens ends with finish_reason "length", incomplete, as OpenAI's does.
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "pets": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "kind": {"type": "string", "enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 20}},
            "required": ["kind"]}}}, "required": ["name", "age", "pets"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    def one(seed):
        return chat(smol_server, {"messages": [{"role": "user", "content": "Describe a person and their pets."}],
                                  "response_format": fmt, "temperature": 1.0, "seed": seed})

    with ThreadPoolExecutor(8) as pool:
        for body in pool.map(one, range(50)):
            choice = body["choices"][0]
            # a budget-forced ending says "length" and parses all the same, on any CPU's sample
            assert choice["finish_reason"] in ("stop", "length"), choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    obj = chat(smol_server, {"messages": [{"role": "user", "content": "Give me JSON."}],
                             "response_format": {"type": "json_object"}, "seed": 3})
    assert isinstance(json.loads(obj["choices"][0]["message"]["content"]), dict)


def test_streamed_tool_call_equals_the_non_streamed_one(smol_server):
    body = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "tools": TOOLS, "tool_choice": "required",
            "temperature": 0.8, "seed": 5}
    full = chat(smol_server, body)["choices"][0]
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={"model": MODEL, **body,
                                                                   "stream": True, "max_tokens": 400}, timeout=300)
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c["choices"][0]["delta"].get("tool_calls") or []:
            entry = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            entry["name"] += tc["function"].get("name") or ""
            entry["arguments"] += tc["function"].get("arguments") or ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    [expected] = full["message"]["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (expected["function"]["name"], json.loads(expected["function"]["arguments"]))]


def test_openai_sdk_parses_tool_calls(smol_server):
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       tools=TOOLS, tool_choice="required", seed=2, max_tokens=400)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(json.loads(call.function.arguments), dict)
    # the call and its result go back in as the next turn
    follow = client.chat.completions.create(model=MODEL, max_tokens=20, tools=TOOLS, messages=[
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].message is not None


def test_tool_choice_none_never_returns_calls(smol_server):
    body = chat(smol_server, {"messages": [{"role": "user", "content": QUESTIONS[0]}], "tools": TOOLS,
                              "tool_choice": "none", "max_tokens": 30, "temperature": 0})
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] != "tool_calls"


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_tools_and_schemas_are_400(smol_server, change, param):
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **change}, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"], r.json()


def test_strict_tools_with_auto_give_text_or_valid_calls(smol_server):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]

    def one(seed):
        return chat(smol_server, {"messages": [{"role": "user", "content": QUESTIONS[seed % len(QUESTIONS)]}],
                                  "tools": strict, "tool_choice": "auto", "temperature": 1.0, "seed": seed})

    with ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(one, range(16)))
    for body in bodies:
        choice = body["choices"][0]
        for call in choice["message"].get("tool_calls", []):
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        if choice["finish_reason"] != "tool_calls":
            assert "tool_calls" not in choice["message"] and choice["message"]["content"]


def _pydantic_tools():
    """Tools as pydantic-based clients send them: openai's pydantic_function_tool (strict, every
    field required) and a plain model_json_schema (instructor, pydantic-ai), both with the inner
    model under $defs."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    class AddPeople(BaseModel):
        people: list[Person]
        note: str | None = None

    strict = openai.pydantic_function_tool(AddPeople, name="add_people")
    plain = {"type": "function", "function": {"name": "add_people", "parameters": AddPeople.model_json_schema()}}
    assert "$defs" in strict["function"]["parameters"] and "$defs" in plain["function"]["parameters"]
    return [strict, plain]


NAMED = {"type": "function", "function": {"name": "add_people"}}


@pytest.mark.parametrize("which, tool_choice", [(0, "required"), (0, NAMED), (0, "auto"), (1, "required"),
                                                (1, NAMED)])  # auto with a non-strict tool is unconstrained
def test_pydantic_tools_with_defs_are_called(smol_server, which, tool_choice):
    tool = _pydantic_tools()[which]
    body = chat(smol_server, {"messages": [{"role": "user", "content": "Add Ann, 31, and Bo, 2."}], "tools": [tool],
                              "tool_choice": tool_choice, "temperature": 0, "max_tokens": 120})
    for call in body["choices"][0]["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    if tool_choice != "auto":
        assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add_people"


def test_tool_without_required_is_accepted(smol_server):
    """langchain, pydantic-ai and the llm CLI leave `required` out when every argument is optional."""
    tool = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 20}, "limit": {"type": "integer"}}}}}
    for tool_choice in ("auto", "required"):
        body = chat(smol_server, {"messages": [{"role": "user", "content": QUESTIONS[2]}], "tools": [tool],
                                  "tool_choice": tool_choice, "temperature": 0, "max_tokens": 60})
        if tool_choice == "required":
            (call,) = body["choices"][0]["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    no_properties = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    body = chat(smol_server, {"messages": [{"role": "user", "content": "What time is it?"}], "tools": [no_properties],
                              "tool_choice": "required", "temperature": 0, "max_tokens": 30})
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "now" and isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("strict", [False, True])
def test_response_format_beside_tools_gives_an_answer_or_a_call(smol_server, strict):
    """openai-agents sends an agent's output type and its tools together: the output is an answer
    in the format or a valid call, never free text, and a call stays possible."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "warm": {"type": "boolean"}},
              "required": ["city", "warm"], "additionalProperties": False}
    tools = [{**WEATHER, "function": {**WEATHER["function"], "strict": strict}}]

    def one(seed):
        return chat(smol_server, {"messages": [{"role": "user", "content": QUESTIONS[seed % 4]}], "tools": tools,
                                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema":
                                                                                             answer}},
                                  "temperature": 1.0, "seed": seed, "max_tokens": 120})

    with ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(one, range(8)))
    for body in bodies:
        message = body["choices"][0]["message"]
        if "tool_calls" in message:
            (call,) = message["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
        else:
            jsonschema.validate(json.loads(message["content"]), answer)
