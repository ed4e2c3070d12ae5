"""Every route of one instance's business plane, asked of a real `mindie cluster` (1P1D, a tiny
model) and of one mixed instance: the same status, the same content type, and the same body
(errors and facts exactly; answers with clocks and ids in them by their shape). The route list is
the instance's own table, so a route added there without a case here fails the test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.cluster import on_free_ports, running
from helpers.pd_routes import normal
from helpers.server import RunningServer, local_settings

from mindie.coordinator.cluster import LocalCluster
from mindie.server.app import BUSINESS, ROUTES

GREEDY = {"do_sample": False, "max_new_tokens": 4}
CHAT = [{"role": "user", "content": "hi"}]
# (method, route path) -> requests (concrete path, JSON body or None), at least one valid and one refused
CASES: dict[tuple[str, str], list[tuple[str, Any]]] = {
    ("POST", "/infer"): [("/infer", {"inputs": "hello", "parameters": GREEDY}), ("/infer", {}),
                         ("/infer", {"inputs": "hi", "parameters": {"max_new_tokens": 0}})],
    ("POST", "/infer_token"): [("/infer_token", {"input_id": [1, 2, 3], "parameters": GREEDY}),
                               ("/infer_token", {"input_id": "x"})],
    ("POST", "/v1/tokenizer"): [("/v1/tokenizer", {"inputs": "hello world"}), ("/v1/tokenizer", {"inputs": ""})],
    ("POST", "/generate"): [("/generate", {"prompt": "the cat", "max_tokens": 4, "temperature": 0}),
                            ("/generate", {"inputs": "the cat", "parameters": GREEDY}), ("/generate", {}),
                            ("/generate", {"prompt": "x", "temperature": -1})],
    ("POST", "/tokenize"): [("/tokenize", {"prompt": "hello world"}), ("/tokenize", {"prompt": 3})],
    ("POST", "/detokenize"): [("/detokenize", {"tokens": [1, 2, 3]}), ("/detokenize", {"tokens": "x"})],
    ("GET", "/tokenizer_info"): [("/tokenizer_info", None)],
    ("POST", "/generate_stream"): [("/generate_stream", {"inputs": "hi", "parameters": GREEDY}),
                                   ("/generate_stream", {"inputs": 5})],
    ("POST", "/"): [("/", {"inputs": "hi", "parameters": GREEDY}), ("/", {"parameters": {}})],
    ("POST", "/v1/chat/completions"): [
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": CHAT}),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}),
        ("/v1/chat/completions", {"model": "other", "messages": CHAT})],
    ("POST", "/v1/completions"): [
        ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 4, "temperature": 0}),
        ("/v1/completions", {"model": "tiny", "prompt": "the", "top_p": 2})],
    # The response store lives in one process, so a cluster does not serve the Responses API (its
    # instances answer 501 whatever the body): test_responses_api_is_refused_by_a_cluster.
    ("POST", "/v1/responses"): [],
    ("GET", "/v1/responses/{response_id}"): [("/v1/responses/resp_nope", None)],
    ("DELETE", "/v1/responses/{response_id}"): [("/v1/responses/resp_nope", None)],
    ("GET", "/v1/models"): [("/v1/models", None)],
    ("GET", "/v1/models/{model}"): [("/v1/models/tiny", None), ("/v1/models/other", None)],
    ("POST", "/v2/models/{model}/generate"): [("/v2/models/tiny/generate", {"text_input": "hi", "parameters": GREEDY}),
                                              ("/v2/models/tiny/generate", {"text_input": 1})],
    ("POST", "/v2/models/{model}/generate_stream"): [
        ("/v2/models/tiny/generate_stream", {"text_input": "hi", "parameters": GREEDY}),
        ("/v2/models/tiny/generate_stream", {})],
    ("POST", "/v2/models/{model}/infer"): [
        ("/v2/models/tiny/infer", {"id": "t1", "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                                                          "data": [1, 2, 3]}],
                                   "outputs": [{"name": "output0"}], "parameters": GREEDY}),
        ("/v2/models/tiny/infer", {"inputs": []})],
    ("POST", "/v2/models/{model}/stopInfer"): [("/v2/models/tiny/stopInfer", {"id": "nobody"}),
                                               ("/v2/models/tiny/stopInfer", {"id": 5})],
    ("GET", "/v2"): [("/v2", None)],
    ("GET", "/v2/models/{model}"): [("/v2/models/tiny", None), ("/v2/models/other", None)],
    ("GET", "/v2/models/{model}/config"): [("/v2/models/tiny/config", None)],
    ("GET", "/health"): [("/health", None)],
    ("GET", "/metrics"): [("/metrics", None)],
    ("GET", "/v2/health/live"): [("/v2/health/live", None)],
    ("GET", "/v2/health/ready"): [("/v2/health/ready", None)],
    ("GET", "/v2/models/{model}/ready"): [("/v2/models/tiny/ready", None), ("/v2/models/other/ready", None)],
}
# Routes no route table entry covers: unknown paths and methods, and bodies refused before any family reads them.
EXTRA: list[tuple[str, str, Any]] = [
    ("GET", "/nowhere", None), ("GET", "/v1/nowhere", None), ("POST", "/v1/nowhere", {}),
    ("GET", "/v1/chat/completions", None), ("GET", "/infer", None), ("DELETE", "/v1/models", None),
    ("GET", "/openapi.json", None),
]
PD_ONLY = {"/dresult"}  # a decode node's record stream, not a client's route
SHAPE_ONLY = {"/v1/models", "/v1/models/tiny", "/v2", "/metrics"}  # clocks, versions and per-process counters


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def _body(response: httpx.Response, path: str) -> Any:
    media = response.headers.get("content-type", "")
    if "text/event-stream" in media or "application/x-ndjson" in media:
        return [normal(json.loads(e[5:])) for e in response.content.split(b"\n\n") if e.startswith(b"data:")
                and e[5:].strip() != b"[DONE]"]
    if "json" in media:
        body = normal(response.json())
        return _shape(body) if path in SHAPE_ONLY else body
    return None if path in SHAPE_ONLY else response.text


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from running(on_free_ports(LocalCluster(1, 1, model=str(tiny_llama_dir), model_name="tiny",
                                                  first_ip="127.0.9.42", workdir=tmp_path_factory.mktemp("routes"))))


@pytest.fixture(scope="module")
def single(tiny_llama_dir: Path):
    server = RunningServer(local_settings(str(tiny_llama_dir), model_name="tiny"))
    yield server
    server.close()


def test_the_case_list_is_the_instance_route_table():
    table = {(r.method, r.path) for r in ROUTES if r.plane == BUSINESS and r.path not in PD_ONLY}
    assert table == set(CASES)


def test_every_route_answers_as_one_instance(cluster: LocalCluster, single: RunningServer) -> None:
    requests = [(method, path, body) for (method, _), cases in CASES.items() for path, body in cases] + EXTRA
    with httpx.Client(trust_env=False, timeout=120) as client:
        for method, path, body in requests:
            kwargs = {"json": body} if body is not None else {}
            pd = client.request(method, cluster.url + path, **kwargs)
            one = client.request(method, single.url + path, **kwargs)
            what = (method, path, body, pd.text[:300], one.text[:300])
            assert pd.status_code == one.status_code, what
            assert pd.headers.get("content-type") == one.headers.get("content-type"), what
            assert _body(pd, path) == _body(one, path), what
        # a body that is not JSON, and one too large, are refused alike
        for headers in ({"content-type": "text/plain"},):
            pd = client.post(cluster.url + "/v1/completions", content=b"x", headers=headers)
            one = client.post(single.url + "/v1/completions", content=b"x", headers=headers)
            assert (pd.status_code, pd.json()) == (one.status_code, one.json()) == (415, one.json())


def test_responses_api_is_refused_by_a_cluster(cluster: LocalCluster) -> None:
    """The store a conversation continues from lives in one process: a cluster says so, in
    OpenAI's error shape, and points at chat completions."""
    with httpx.Client(trust_env=False, timeout=60) as client:
        reply = client.post(cluster.url + "/v1/responses", json={"model": "tiny", "input": "hi"})
    assert reply.status_code == 501
    assert "/v1/chat/completions" in reply.json()["error"]["message"]


def test_openai_sdk_and_tritonclient_probes_work_against_a_cluster(cluster: LocalCluster) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", http_client=httpx.Client(trust_env=False))
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    assert sdk.models.retrieve("tiny").id == "tiny"
    tritonclient_http = pytest.importorskip("tritonclient.http")
    triton = tritonclient_http.InferenceServerClient(cluster.url.removeprefix("http://"))
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready("tiny")
    assert triton.get_model_metadata("tiny")["name"] == "tiny"
