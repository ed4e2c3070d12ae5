"""Fake P and D instances that follow the PD wire protocol, and a one-loop cluster of them behind a
real coordinator, all on 127.0.0.x with real HTTP.

A fake instance serves its business and management routes on one port. As D it keeps one
`GET /dresult` stream (a new GET closes the old one with a `close:` record) and emits the records a
test asks for; as P it answers an inference request with a script, by default the protocol's happy
path: tell D to stream the rest (before answering, as a real P does), then reply with the envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import uvicorn
from helpers.server import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mindie.coordinator.config import CoordinatorConfig, Role, parse_instances
from mindie.coordinator.launcher import serve
from mindie.coordinator.service import Coordinator
from mindie.pd.records import RecordKind, close_record, encode

MODEL = "fake-model"
PScript = Callable[["FakeInstance", Request, bytes], Awaitable[Response]]


def event(text: str, path: str = "/infer") -> bytes:
    """One stream event in the framing of the route's family."""
    if path == "/generate":
        return json.dumps({"text": [text]}).encode() + b"\0"
    if path.startswith("/v2/models/"):
        return b"data:" + json.dumps({"text_output": text}).encode() + b"\n\n"
    return b"data: " + json.dumps({"text": text}).encode() + b"\n\n"


def is_stream(path: str, body: bytes) -> bool:
    return path.endswith("generate_stream") or bool(json.loads(body).get("stream", False))


@dataclass(eq=False)
class FakeInstance:
    role: Role
    host: str
    port: int = 0
    cluster: dict[int, FakeInstance] = field(default_factory=dict)  # port -> instance, shared by all fakes
    script: PScript | None = None
    role_bodies: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    dresult_gets: int = 0
    status: dict[str, int] | None = field(default_factory=lambda: {"availSlotsNum": 200, "availBlockNum": 1000})
    refuse_dresult: bool = False
    _stream: asyncio.Queue[bytes | None] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port(self.host)
        self.cluster[self.port] = self

    @property
    def spec_entry(self) -> dict[str, Any]:
        return {"role": self.role.value, "ip": self.host, "port": self.port, "mgmt_port": self.port,
                "inter_comm_port": 1121}

    # D side
    def emit(self, req_id: str, kind: RecordKind, body: bytes | str) -> None:
        assert self._stream is not None, "no /dresult stream is open"
        self._stream.put_nowait(encode(req_id, kind, body))

    def emit_raw(self, chunk: bytes) -> None:
        assert self._stream is not None, "no /dresult stream is open"
        self._stream.put_nowait(chunk)

    def drop_stream(self) -> None:
        """Ends the current /dresult response, as a D that restarts would."""
        if self._stream is not None:
            self._stream.put_nowait(None)
            self._stream = None

    @property
    def linked(self) -> bool:
        return self._stream is not None

    async def _dresult(self, request: Request) -> Response:
        if self.refuse_dresult:
            return JSONResponse({"error": "not now", "error_type": "Service Unavailable"}, status_code=503)
        self.dresult_gets += 1
        if self._stream is not None:
            self._stream.put_nowait(close_record())
            self._stream.put_nowait(None)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._stream = queue

        async def chunks() -> AsyncIterator[bytes]:
            while (chunk := await queue.get()) is not None:
                yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream")

    # P side
    async def _infer(self, request: Request) -> Response:
        body = await request.body()
        self.requests.append((request.url.path, dict(request.headers), body))
        return await (self.script or relay_happy_path)(self, request, body)

    def decode_of(self, request: Request) -> FakeInstance:
        return self.cluster[int(request.headers["d-port"])]

    # both
    async def _stop(self, request: Request) -> Response:
        body = await request.json()
        self.stopped.append(body["id"])
        return JSONResponse(body)

    async def _role(self, request: Request) -> Response:
        self.role_bodies.append(await request.json())
        return JSONResponse({"result": "OK"})

    async def _config(self, request: Request) -> Response:
        return JSONResponse({"modelName": MODEL, "maxSeqLen": 512, "cacheBlockSize": 16})

    async def _status(self, request: Request) -> Response:
        return JSONResponse({"service": {"roleStatus": "RoleReady", "currentRole": self.role.value},
                             "resource": self.status, "linkStatus": {"peers": []}})

    async def _metrics(self, request: Request) -> Response:
        return Response(f"# HELP request_received_total Requests received\n"
                        f"# TYPE request_received_total counter\n"
                        f'request_received_total{{model_name="{MODEL}"}} {len(self.requests) + 3}\n'
                        f"# HELP num_requests_running Requests running\n# TYPE num_requests_running gauge\n"
                        f'num_requests_running{{model_name="{MODEL}"}} 1\n', media_type="text/plain")

    async def _tokenizer(self, request: Request) -> Response:
        return JSONResponse({"token_number": 2, "tokens": ["a", "b"], "by": self.port})

    def app(self) -> Starlette:
        inference = ["/infer", "/infer_token", "/generate", "/generate_stream", "/", "/v1/chat/completions",
                     "/v1/completions", "/v2/models/{m}/generate", "/v2/models/{m}/generate_stream",
                     "/v2/models/{m}/infer"]
        return Starlette(routes=[
            *[Route(p, self._infer, methods=["POST"]) for p in inference],
            Route("/dresult", self._dresult, methods=["GET"]),
            Route("/v2/models/{m}/stopInfer", self._stop, methods=["POST"]),
            Route("/v1/tokenizer", self._tokenizer, methods=["POST"]),
            Route("/v1/role/{role}", self._role, methods=["POST"]),
            Route("/v1/config", self._config, methods=["GET"]),
            Route("/v1/status", self._status, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ])


class RoleAware(FakeInstance):
    """A fake whose /v1/status shows the role it was last given ("none" before), as a real one does."""

    current_role = "none"

    async def _role(self, request: Request) -> Response:
        self.current_role = request.path_params["role"]
        return await super()._role(request)

    async def _status(self, request: Request) -> Response:
        return JSONResponse({"service": {"currentRole": self.current_role}, "resource": self.status,
                             "linkStatus": {"peers": []}})


async def relay_happy_path(p: FakeInstance, request: Request, body: bytes) -> Response:
    """D gets the rest of the answer before P replies (as in MindIE, P tells D first)."""
    rid, path = request.headers["req-id"], request.url.path
    d = p.decode_of(request)
    if is_stream(path, body):
        d.emit(rid, RecordKind.DATA, event("B", path))
        d.emit(rid, RecordKind.LAST_DATA, event("C", path))
        await asyncio.sleep(0.05)  # D's records reach the coordinator before this reply
        return JSONResponse({"reqId": rid, "isStream": True, "isLastResp": False, "output": event("A", path).decode()})
    d.emit(rid, RecordKind.LAST_DATA, json.dumps({"whole": "ABC"}))
    await asyncio.sleep(0.05)
    return JSONResponse({"reqId": rid, "isStream": False})


@dataclass
class Cluster:
    coord: Coordinator
    prefills: list[FakeInstance]
    decodes: list[FakeInstance]
    client: httpx.AsyncClient
    servers: list[uvicorn.Server]  # prefills then decodes

    @property
    def url(self) -> str:
        c = self.coord.config
        return f"http://{c.predict_ip}:{c.predict_port}"

    def plane(self, port: int) -> str:
        return f"http://{self.coord.config.manage_ip}:{port}"


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")



@contextlib.asynccontextmanager
async def cluster(n_p: int = 1, n_d: int = 1, silence_limit_s: float = 15.0, wait_ready: bool = True,
                  **config: Any) -> AsyncIterator[Cluster]:
    shared: dict[int, FakeInstance] = {}
    hosts = iter(f"127.0.0.{i}" for i in range(2, 250))
    prefills = [FakeInstance(Role.PREFILL, next(hosts), cluster=shared) for _ in range(n_p)]
    decodes = [FakeInstance(Role.DECODE, next(hosts), cluster=shared) for _ in range(n_d)]
    servers = [uvicorn.Server(uvicorn.Config(f.app(), host=f.host, port=f.port, log_level="warning",
                                             lifespan="off", timeout_graceful_shutdown=1)) for f in prefills + decodes]
    tasks = [asyncio.ensure_future(s.serve()) for s in servers]
    await until(lambda: all(s.started for s in servers))
    base = CoordinatorConfig(predict_ip="127.0.0.1", predict_port=free_port("127.0.0.1"), manage_ip="127.0.0.1",
                             manage_port=free_port("127.0.0.1"), external_port=free_port("127.0.0.1"),
                             status_port=free_port("127.0.0.1"), max_retry=2,
                             instances=parse_instances([f.spec_entry for f in prefills + decodes]))
    coord = Coordinator(replace(base, **config), silence_limit_s=silence_limit_s)
    stop = asyncio.Event()
    coordinator = asyncio.ensure_future(serve(coord, stop, announce=False))
    client = httpx.AsyncClient(timeout=10, trust_env=False)
    try:
        if wait_ready:
            await until(lambda: coord.registry.ready)
        yield Cluster(coord, prefills, decodes, client, servers)
    finally:
        await client.aclose()
        for d in decodes:
            d.drop_stream()
        stop.set()
        await coordinator
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)
