"""OpenAI's Responses API (/v1/responses) against the embedded SmolLM2: the openai SDK's typed client,
stream events in OpenAI's order, function calls and their outputs, stored responses and
previous_response_id, structured output, refusals in OpenAI's error shape, and an openai-agents
Agent. Greedy responses are compared with greedy chat completions of the same messages: both go
through one chat template, so text, token counts and prompt sizes must be equal."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.models.openai_responses import OpenAIResponsesModel
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from mindie.server.protocols.openai_responses import OutputItems
from mindie.server.protocols.responses_store import ResponseStore, stored_response

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                      "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMETERS}
TIME = {"type": "function", "name": "get_time", "description": "The time in a time zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
    "additionalProperties": False}}
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def chat_tool(tool):
    """A Responses function tool in chat's nested shape, strict as the Responses API defaults."""
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["parameters"], "strict": True}}


STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def events(response: httpx.Response) -> list[dict]:
    """A Responses stream's events, each checked to name its type on its `event:` line and to
    validate (every required field) as the SDK's type of that event."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.removesuffix("\n\n").split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        STREAM_EVENT.validate_python(data)
        out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def stream(server, body) -> list[dict]:
    return events(httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body, "stream": True}, timeout=300))


# --- text ----------------------------------------------------------------------------------------


def test_greedy_response_equals_greedy_chat(client):
    r = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", temperature=0, max_output_tokens=24,
                                metadata={"case": "greedy"}, user="u1")
    c = chat(client, [{"role": "system", "content": "Answer in one short sentence."},
                      {"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
    assert isinstance(r, Response) and r.object == "response" and r.id.startswith("resp_")
    [message] = r.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    assert r.output_text == c.choices[0].message.content and "Paris" in r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    finished = c.choices[0].finish_reason == "stop"
    assert (r.status, message.status) == (("completed",) * 2 if finished else ("incomplete",) * 2)
    # the request's fields, echoed
    assert (r.instructions, r.temperature, r.max_output_tokens, r.metadata, r.user, r.store) == (
        "Answer in one short sentence.", 0, 24, {"case": "greedy"}, "u1", True)
    assert (r.tools, r.tool_choice, r.text.format.type, r.parallel_tool_calls, r.model) == (
        [], "auto", "text", True, MODEL)


def test_input_items_are_the_chat_messages(client):
    """Roles, content parts and an earlier assistant turn render exactly as chat's messages."""
    items = [{"type": "message", "role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit"},
                                          {"type": "input_text", "text": " that is red."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Apple.",
                                                                   "annotations": []}]},
             {"role": "user", "content": "And one that is yellow?"}]
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": "Name a fruit that is red."},
                {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "And one that is yellow?"}]
    r = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=12)
    c = chat(client, messages, max_tokens=12)
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)


def test_stream_events_follow_openai_order(smol_server, client):
    body = {"input": "Write one sentence about the sea.", "temperature": 0, "max_output_tokens": 20}
    whole = client.responses.create(model=MODEL, **body)
    evs = stream(smol_server, body)
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    final = evs[-1]["response"]
    expected = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                "response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e["type"] for e in evs] == expected
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    item_id = evs[2]["item"]["id"]
    assert all((d["item_id"], d["output_index"], d["content_index"], d["logprobs"]) == (item_id, 0, 0, [])
               for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == evs[-4]["text"] == final["output"][0]["content"][0]["text"] == whole.output_text
    assert evs[-2]["item"] == final["output"][0] and final["id"] == evs[0]["response"]["id"]
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    assert Response.model_validate(final).output_text == text
    # the stored response is the one the stream ended with
    assert httpx.get(f"{smol_server.url}/v1/responses/{final['id']}").json() == final


def test_sdk_stream_and_stream_helper(client):
    # the helper's final response comes only with response.completed: a response that ends by itself
    body = {"model": MODEL, "input": "Say hello.", "temperature": 0, "max_output_tokens": 40}
    whole = client.responses.create(**body)
    typed = list(client.responses.create(**body, stream=True))
    assert (typed[0].type, typed[-1].type, whole.status) == ("response.created", "response.completed", "completed")
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == whole.output_text
    with client.responses.stream(**body) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert text == final.output_text == whole.output_text


def test_max_output_tokens_ends_incomplete(smol_server, client):
    r = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[0].status == "incomplete"
    evs = stream(smol_server, {"input": "Tell me a long story about a dragon.", "max_output_tokens": 3})
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# --- function tools ------------------------------------------------------------------------------


def test_required_tool_call_is_a_valid_function_call_item(client):
    r = client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER, TIME],
                                tool_choice="required", temperature=0)
    [call] = r.output
    assert isinstance(call, ResponseFunctionToolCall) and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    c = chat(client, [{"role": "user", "content": "What's the weather in Paris?"}],
             tools=[chat_tool(WEATHER), chat_tool(TIME)], tool_choice="required")
    [expected] = c.choices[0].message.tool_calls
    assert (call.name, json.loads(call.arguments)) == (expected.function.name, json.loads(expected.function.arguments))
    assert r.tools[0].name == "get_weather" and r.tools[0].strict is True and r.tool_choice == "required"
    named = client.responses.create(model=MODEL, input="Hello!", tools=[WEATHER, TIME], temperature=0,
                                    tool_choice={"type": "function", "name": "get_time"})
    [call] = named.output
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET", "PST")
    assert named.tool_choice.name == "get_time"


def test_streamed_function_call_equals_the_whole_one(smol_server, client):
    body = {"input": "What's the weather in Oslo?", "tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    [whole] = client.responses.create(model=MODEL, **body).output
    evs = stream(smol_server, body)
    types = [e["type"] for e in evs]
    n = types.count("response.function_call_arguments.delta")
    assert n > 0 and types == ["response.created", "response.in_progress", "response.output_item.added",
                               *["response.function_call_arguments.delta"] * n,
                               "response.function_call_arguments.done", "response.output_item.done",
                               "response.completed"]
    added, done, final = evs[2]["item"], evs[-2]["item"], evs[-1]["response"]
    assert (added["type"], added["status"], added["arguments"]) == ("function_call", "in_progress", "")
    arguments = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert arguments == evs[-3]["arguments"] == done["arguments"] == whole.arguments
    assert done["status"] == "completed" and done["id"] == added["id"] and final["output"] == [done]


def test_function_call_output_continues_the_conversation(client):
    """A follow-up through previous_response_id, the same turn replayed as items, and chat with the
    same messages build one prompt and answer alike."""
    question = "What's the weather in Paris?"
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                    temperature=0)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     temperature=0, max_output_tokens=40)
    replayed = client.responses.create(model=MODEL, input=[{"role": "user", "content": question},
                                                           call.model_dump(exclude_none=True), result],
                                       tools=[WEATHER], temperature=0, max_output_tokens=40)
    c = chat(client, [{"role": "user", "content": question},
                      {"role": "assistant", "content": None, "tool_calls": [{
                          "id": call.call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
             tools=[chat_tool(WEATHER)], max_tokens=40)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == replayed.usage.input_tokens == c.usage.prompt_tokens
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.output_text == replayed.output_text == c.choices[0].message.content
    assert "21" in follow.output_text


def test_previous_response_id_prepends_the_earlier_turn(client):
    first = client.responses.create(model=MODEL, instructions="You are a helpful assistant.",
                                    input="My name is Ada.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=16)
    # instructions are not carried over, as OpenAI's
    c = chat(client, [{"role": "user", "content": "My name is Ada."},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "What is my name?"}], max_tokens=16)
    alone = chat(client, [{"role": "user", "content": "What is my name?"}], max_tokens=1)
    assert second.usage.input_tokens == c.usage.prompt_tokens > alone.usage.prompt_tokens + first.usage.output_tokens
    assert second.output_text == c.choices[0].message.content
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks!", temperature=0,
                                    max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    """The output the model writes, in any chunking, against the whole text at once."""
    text = 'Checking. [{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
           '{"name": "get_time", "arguments": {"zone": "CET"}}]'

    def items(chunk: int, max_calls):
        out = OutputItems(["get_weather", "get_time"], max_calls)
        for i in range(0, len(text), chunk):
            out.feed(text[i:i + chunk])
        out.finish("completed")
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in out.items]

    message = {"type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]}
    weather = {"type": "function_call", "status": "completed", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    zone = {"type": "function_call", "status": "completed", "name": "get_time", "arguments": '{"zone": "CET"}'}
    for chunk in (1, 3, 7, len(text)):
        assert items(chunk, None) == [message, weather, zone]
        assert items(chunk, 1) == [message, weather]


# --- structured output ---------------------------------------------------------------------------


def test_json_schema_format_validates(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    for _ in range(3):
        r = client.responses.create(model=MODEL, input="Describe a big city.", text={"format": fmt},
                                    temperature=1.0, max_output_tokens=60)
        jsonschema.validate(json.loads(r.output_text), CITY)
        assert r.text.format.name == "city" and r.text.format.schema_ == CITY

    class City(BaseModel):
        name: str
        population: int

    parsed = client.responses.parse(model=MODEL, input="Describe Paris.", text_format=City, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City)
    obj = client.responses.create(model=MODEL, input="Give me JSON.", text={"format": {"type": "json_object"}},
                                  temperature=0, max_output_tokens=40)
    assert isinstance(json.loads(obj.output_text), dict)


# --- the store -----------------------------------------------------------------------------------


def test_stored_responses_can_be_read_and_deleted(smol_server, client):
    kept = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    client.responses.delete(kept.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(kept.id)
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    r = httpx.post(smol_server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                            "previous_response_id": unkept.id})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"Previous response with id '{unkept.id}' not found.",
                                  "type": "not_found_error", "param": "previous_response_id",
                                  "code": "previous_response_not_found"}}


def test_store_is_a_bounded_lru():
    def entry(text):
        return stored_response({"id": text[:1]}, [{"role": "user", "content": text}])

    store = ResponseStore(max_entries=2, max_chars=1000)
    a, b, c = entry("a"), entry("b"), entry("c")
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # now the most recently used
    store.put("c", c)
    assert (store.get("a"), store.get("b"), store.get("c"), len(store)) == (a, None, c, 2)
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    store = ResponseStore(max_entries=10, max_chars=1000)
    store.put("big", entry("x" * 1000))  # alone over the character budget: not kept
    assert (store.get("big"), len(store)) == (None, 0)
    x, y, z = entry("x" * 400), entry("y" * 400), entry("z" * 400)
    for key, e in (("x", x), ("y", y), ("z", z)):
        store.put(key, e)  # three of them are over the budget: the least recently used goes
    assert (store.get("x"), store.get("y"), store.get("z")) == (None, y, z)


# --- refusals ------------------------------------------------------------------------------------

USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("change,status,param", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, 400, "tools[1].type"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://example.com"}]}, 400, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, 400, "tools[0].parameters.type"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_123"}, 400, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include[0]"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": CITY}}, "max_output_tokens": 2}, 400,
     "max_output_tokens"),
    # a text-only model: the image part is refused, naming the model (tests/server/test_vision_routes.py)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [USER, {"type": "reasoning", "id": "rs_1", "summary": []}]}, 400, "input[1].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": ""}]}, 400, "input[0].output"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": ""}, 400, "input"),
    ({"temperature": 2.5}, 400, "temperature"),
    ({"metadata": {"k": "v" * 513}}, 400, "metadata"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
])
def test_what_cannot_be_honoured_is_refused(smol_server, change, status, param):
    r = httpx.post(smol_server.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                            **change}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert error["code"] is None or isinstance(error["code"], str)


def test_sdk_raises_on_refusals(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert "function tools" in err.value.message and err.value.code == "unsupported_value"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")


def test_routes_are_documented(smol_server):
    paths = httpx.get(smol_server.url + "/openapi.json").json()["paths"]
    assert set(paths["/v1/responses"]) == {"post"} and set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}


# --- openai-agents -------------------------------------------------------------------------------


def test_openai_agents_agent_runs_a_tool_loop(smol_server):
    """openai-agents' default model (OpenAIResponsesModel) drives a whole agent turn: the tool is
    called with schema-valid arguments, its output goes back, and the agent answers in text."""
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny, 21 C"

    client = openai.AsyncOpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(MODEL, client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = asyncio.run(Runner.run(agent, "What's the weather in Paris?", max_turns=4))
    assert cities == ["Paris"]
    assert [type(i) for i in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert isinstance(result.final_output, str) and "21" in result.final_output
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)
