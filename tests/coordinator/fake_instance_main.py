"""A fake P or D instance as its own process, started by `LocalCluster` in place of `mindie serve`:
it reads the config.json the launcher wrote and serves the fake's routes on the business and
management ports. As P it reaches D over HTTP (`POST /fake/emit` on D's business port, with the
cluster's inter-instance token), as a real P reaches D on its P<->D port."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))  # helpers, which fakes imports

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fakes import FakeInstance, RoleAware, event, is_stream  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from mindie.coordinator.config import Role  # noqa: E402
from mindie.pd.records import RecordKind  # noqa: E402


async def main(config_path: str) -> None:
    server = json.loads(Path(config_path).read_text())["ServerConfig"]
    assert server["inferMode"] == "dmi" and server["interCommPort"] == server["port"] + 96
    token = server["interCommToken"]
    # roleless until /v1/role, as a real instance: one restarted gets its role again from the coordinator
    fake = RoleAware(Role.PREFILL, server["ipAddress"], server["port"])

    async def over_http(p: FakeInstance, request: Request, body: bytes) -> Response:
        rid, path = request.headers["req-id"], request.url.path
        d_ip = request.headers["d-target"].split(";")[0]
        records = [["data", event("B", path).decode()], ["lastData", event("C", path).decode()]] if is_stream(
            path, body) else [["lastData", json.dumps({"whole": "ABC"})]]
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                told = await client.post(f"http://{d_ip}:{request.headers['d-port']}/fake/emit",
                                         json={"reqId": rid, "records": records}, headers={"x-token": token})
            why = None if told.status_code == 200 else f"D answered HTTP {told.status_code}"
        except httpx.HTTPError as exc:
            why = str(exc) or type(exc).__name__
        if why is not None:  # a real P's answer when it cannot hand the request to D
            return JSONResponse({"error": f"[P Node] Send D request failed:{why}",
                                 "error_type": "Incomplete Generation"}, status_code=500)
        await asyncio.sleep(0.05)
        stream = is_stream(path, body)
        return JSONResponse({"reqId": rid, "isStream": stream,
                             **({"isLastResp": False, "output": event("A", path).decode()} if stream else {})})

    async def emit(request: Request) -> Response:
        if request.headers.get("x-token") != token:
            return JSONResponse({"error": "bad token"}, status_code=401)
        body = await request.json()
        for kind, text in body["records"]:
            fake.emit(body["reqId"], RecordKind(kind), text)
        return JSONResponse({"ok": True})

    fake.script = over_http
    app = fake.app()
    app.router.routes.append(Route("/fake/emit", emit, methods=["POST"]))
    servers = [uvicorn.Server(uvicorn.Config(app, host=server["ipAddress"], port=port, log_level="warning",
                                             lifespan="off", timeout_graceful_shutdown=1))
               for port in (server["port"], server["managementPort"])]
    await asyncio.gather(*(s.serve() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
