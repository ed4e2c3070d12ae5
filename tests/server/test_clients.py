"""Clients people point at an OpenAI-compatible server, unchanged, against the embedded model:
pydantic-ai's `openai:` model (the Responses API), langchain with `use_responses_api` and a tool
whose arguments are all optional (no `required`), and instructor's default mode with a model
inside a model (`$defs`). Each answer is compared with what the server itself returns for the
same request. (openai-agents' default model: tests/server/test_responses.py.)"""

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture
def openai_env(smol_server, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", smol_server.url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    return smol_server


def responses_text(server, body: dict) -> str:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return "".join(c["text"] for item in r.json()["output"] if item["type"] == "message" for c in item["content"])


def test_pydantic_ai_openai_model(openai_env):
    from pydantic_ai import Agent

    class City(BaseModel):
        city: str
        population: int

    answer = Agent(f"openai:{MODEL}", model_settings={"temperature": 0, "max_tokens": 40}).run_sync(QUESTION)
    assert answer.output == responses_text(openai_env, {"input": QUESTION, "temperature": 0, "max_output_tokens": 40})
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    replies: list[dict] = []

    async def keep(response: httpx.Response) -> None:
        await response.aread()
        replies.append(response.json())

    client = openai.AsyncOpenAI(base_url=openai_env.url + "/v1", api_key="unused",
                                http_client=httpx.AsyncClient(event_hooks={"response": [keep]}))
    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(openai_client=client))
    typed = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 80})
    city = typed.run_sync("Paris has 2100000 people.").output
    (call,) = [item for item in replies[-1]["output"] if item["type"] == "function_call"]
    assert isinstance(city, City) and city.model_dump() == json.loads(call["arguments"])  # the server's call, read


def test_langchain_responses_api_and_a_tool_without_required(openai_env):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, use_responses_api=True, temperature=0, max_tokens=40)
    content = llm.invoke(QUESTION).content
    text = content if isinstance(content, str) else "".join(part["text"] for part in content)
    assert text == responses_text(openai_env, {"input": [{"role": "user", "content": QUESTION}], "temperature": 0,
                                               "max_output_tokens": 40})

    @tool
    def search(query: str = "", limit: int = 5) -> str:
        """Search the web."""
        return ""

    assert "required" not in search.tool_call_schema.model_json_schema()
    for responses in (False, True):
        bound = ChatOpenAI(model=MODEL, use_responses_api=responses, temperature=0, max_tokens=60).bind_tools(
            [search], tool_choice="required")
        (call,) = bound.invoke("Find papers about paged attention.").tool_calls
        assert call["name"] == "search" and set(call["args"]) <= {"query", "limit"}
        search.args_schema.model_validate(call["args"])


def test_instructor_default_mode_with_a_nested_model(smol_server):
    import instructor

    class Pet(BaseModel):
        kind: str
        count: int

    class Person(BaseModel):
        name: str
        age: int
        pets: list[Pet]

    sent: list[bytes] = []
    http = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.read())]})
    client = instructor.from_openai(openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused",
                                                  http_client=http))
    messages = [{"role": "user", "content": "Tom is 31 years old and has 2 cats."}]
    person = client.chat.completions.create(model=MODEL, response_model=Person, temperature=0, max_tokens=120,
                                            max_retries=0, messages=messages)
    body = json.loads(sent[-1])
    assert "$defs" in body["tools"][0]["function"]["parameters"]  # the form that was a 400 before
    replay = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    arguments = replay["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert person.model_dump() == json.loads(arguments)  # what the server wrote, as the client read it
