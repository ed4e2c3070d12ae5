"""An instance in prefill/decode disaggregation (`inferMode: "dmi"`): its role, its peers, the
checks every PD request passes, and the pieces the P flow (server/prefill.py) and the D flow
(server/decode.py) share: the KV transport, P's leases on exported blocks, D's /dresult stream.

The server starts with no role: inference answers 503 until the coordinator (or a controller)
POSTs `/v1/role/{prefill|decode|flex}` with MindIE's body. P talks only to the D instances named
as its peers there, and D accepts decode calls and serves pulls only for the P instances named as
its peers; every call between instances carries the shared inter-instance token.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from mindie.engine.commands import ReleaseKV
from mindie.pd.http import TOKEN_HEADER
from mindie.pd.media import HeldBodies
from mindie.pd.tcp_transport import TCPTransport
from mindie.pd.transport import KVArena, KVLayout
from mindie.server.dresult import DResultDispatcher
from mindie.server.errors import APIError
from mindie.server.http import json_response

log = logging.getLogger("mindie.server.dmi")

ROLES_V1 = ("prefill", "decode", "flex")
ROLES_V2 = ("prefill", "decode")
UNKNOWN_STATUS = "The server cannot process the inference request due to an unknown status."
BAD_ROLE_BODY = "Req body converts to json fail. Reset to previous node status."
REQ_ID = re.compile(r"[0-9a-fA-F]{1,1024}")


@dataclass(frozen=True)
class PDHeaders:
    req_id: str
    d_host: str
    d_port: int  # D's interCommPort: from d-target, else the same as this instance's
    recompute: bool  # is-recompute: the body is one a decode node sent back (mindie/pd/recompute.py)


PREEMPT_ENV = "MINDIE_PD_PREEMPT_AT"


@dataclass(frozen=True)
class ForcedPreemption:
    """A test hook, from a decode node's environment: MINDIE_PD_PREEMPT_AT="K" preempts every
    request handed to it once it has K outputs, "K/E" every E-th one; recomputes (which arrive
    with more than K) never. Off when unset."""

    at: int
    every: int = 1

    @classmethod
    def from_env(cls, value: str | None) -> ForcedPreemption | None:
        if not value:
            return None
        at, _, every = value.partition("/")
        try:
            hook = cls(int(at), int(every or 1))
        except ValueError:
            raise ValueError(f"{PREEMPT_ENV} must be K or K/E with integers K >= 1, E >= 1, got {value!r}") from None
        if hook.at < 1 or hook.every < 1:
            raise ValueError(f"{PREEMPT_ENV} must be K or K/E with integers K >= 1, E >= 1, got {value!r}")
        return hook


@dataclass(frozen=True)
class GenerationRoute:
    template: str  # e.g. /v2/models/{model}/generate
    parse: Callable[..., Any]  # the family's parse (server/handler.py's Parse)

    def match(self, path: str) -> dict[str, str] | None:
        m = compile_path(self.template)[0].match(path)
        return m.groupdict() if m else None


MAX_EARLY_STOPS = 10_000  # stops of requests D has not seen yet, remembered at most (a bound on memory)


class PDNode:
    def __init__(self, settings: Any, engine: Any) -> None:
        if not settings.inter_comm_token:
            raise ValueError("a PD node needs the inter-instance token (ServerConfig.interCommToken)")
        self.settings = settings
        self.token: str = settings.inter_comm_token
        self.engine = engine  # the AsyncEngine
        self.role = "none"
        self.p_percentage: int | None = None
        self.peers: dict[str, str] = {}  # peer server_ip -> link state (waiting / success / failed)
        self.routes: list[GenerationRoute] = []  # set by build_apps
        self.dispatcher = DResultDispatcher(settings.dresult_heartbeat_s)
        # Names this process on its /dresult stream: a coordinator that re-links and sees another
        # one knows the requests it had here are gone (the instance restarted).
        self.epoch = secrets.token_hex(8)
        self.leases: dict[str, tuple[str, asyncio.TimerHandle]] = {}  # P: req-id -> (lease id, expiry)
        # P: bodies with media handed to D, for a recompute to read them again
        self.held_media = HeldBodies(settings.media_hold_bytes, settings.media_hold_s)
        self.decoding: dict[str, asyncio.Task[None]] = {}  # D: req-id -> its decode task
        self.stopped: set[str] = set()  # D: req-ids stopped before their KV arrived
        self.early_stops: dict[str, float] = {}  # D: req-id -> until when a stop that came before P's call holds
        self.preemption = ForcedPreemption.from_env(os.environ.get(PREEMPT_ENV))
        self.handed_over = 0  # D: requests handed to it so far, for the test hook's every E-th
        inner = engine.engine
        caches = inner.runner.kv_caches
        k0 = caches[0][0]
        self.layout = KVLayout(model=settings.model_name, dtype=str(k0.dtype).removeprefix("torch."),
                               num_layers=len(caches), num_kv_heads=k0.shape[2], head_dim=k0.shape[3],
                               block_size=k0.shape[1], weight_format=type(inner.loaded.model).__name__)
        arena = KVArena([(k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()) for k, v in caches])
        self.transport = TCPTransport(arena, self.layout, self.token, settings.host,
                                      settings.kv_transfer_port, settings.kv_trans_timeout_s)

    def close(self) -> None:
        self.transport.close()

    # --- role --------------------------------------------------------------------------------

    @property
    def is_prefill(self) -> bool:
        return self.role == "prefill" or (self.role == "flex" and self.p_percentage != 0)

    @property
    def is_decode(self) -> bool:
        return self.role in ("decode", "flex")

    def status(self) -> dict[str, Any]:
        service: dict[str, Any] = {"roleStatus": "RoleUnknown" if self.role == "none" else "RoleReady",
                                   "currentRole": self.role}
        if self.role == "flex":
            service["p_percentage"] = self.p_percentage
        return {"service": service, "peers": [{"target": ip, "link": state} for ip, state in self.peers.items()]}

    def set_role(self, role: str, body: bytes, v2: bool) -> None:
        local, peers = _role_body(body, v2)
        p_percentage = local[0].get("p_percentage") if role == "flex" else None
        if p_percentage is not None and not (isinstance(p_percentage, int) and 0 <= p_percentage <= 100):
            raise APIError(422, BAD_ROLE_BODY, "p_percentage")
        self.role, self.p_percentage = role, p_percentage
        self.peers = {p["server_ip"]: self.peers.get(p["server_ip"], "waiting") for p in peers}

    def link(self, peer: str, ok: bool) -> None:
        if peer in self.peers:
            self.peers[peer] = "success" if ok else "failed"

    # --- checks ------------------------------------------------------------------------------

    def check_inference(self) -> None:
        if self.role == "none":
            raise APIError(503, UNKNOWN_STATUS)
        if not self.is_prefill:
            raise APIError(400, "DMI inference requests can be sent only to the prefill node or p_percentage of "
                                "the flex node == 0")

    def check_token(self, request: Request) -> None:
        got = request.headers.get(TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(got, self.token.encode()):
            raise APIError(401, f"the inter-instance token ({TOKEN_HEADER}) is missing or wrong")

    def check_peer(self, request: Request) -> None:
        host = request.client.host if request.client else ""
        if host not in self.peers:
            log.warning("refused a call from %s: not a peer", host)
            raise APIError(403, "the caller is not a peer of this instance (see /v1/role)")

    # --- P: leases on exported blocks --------------------------------------------------------

    def hold(self, req_id: str, lease_id: str) -> None:
        """Keeps the blocks until D releases them, or for 2 x kv_trans_timeout at most."""
        expiry = asyncio.get_running_loop().call_later(2 * self.settings.kv_trans_timeout_s, self.release, req_id)
        self.leases[req_id] = (lease_id, expiry)

    def release(self, req_id: str) -> bool:
        held = self.leases.pop(req_id, None)
        if held is None:
            return False
        lease_id, expiry = held
        expiry.cancel()
        self.transport.release(req_id)
        self.engine.submit(ReleaseKV(lease_id))
        return True

    # --- D -----------------------------------------------------------------------------------

    def stop(self, req_id: str) -> None:
        """stopInfer: a request whose KV is still on its way is dropped when it arrives. The
        coordinator stops P and D at once, so the stop may also come before P has handed the
        request over (P between its first token and its call to D): that call is then refused,
        for as long as P's lease could make it (2 x kv_trans_timeout). On P the request is over:
        the media it held for a recompute go."""
        self.held_media.drop(req_id)
        if req_id in self.decoding:
            self.stopped.add(req_id)
        elif self.is_decode:
            now = time.monotonic()
            if len(self.early_stops) >= MAX_EARLY_STOPS:
                self.early_stops = {r: t for r, t in self.early_stops.items() if t > now}
            if len(self.early_stops) < MAX_EARLY_STOPS:
                self.early_stops[req_id] = now + 2 * self.settings.kv_trans_timeout_s

    def forced_preemption(self, num_outputs: int) -> int | None:
        """The test hook's `preempt_at` for the next request handed over with `num_outputs`."""
        self.handed_over += 1
        hook = self.preemption
        if hook is None or num_outputs >= hook.at or self.handed_over % hook.every:
            return None
        return hook.at

    def stopped_early(self, req_id: str) -> bool:
        return self.early_stops.pop(req_id, 0.0) > time.monotonic()

    def find_route(self, path: str) -> tuple[GenerationRoute, dict[str, str]] | None:
        for route in self.routes:
            params = route.match(path)
            if params is not None:
                return route, params
        return None


def parse_headers(request: Request, own_port: int) -> PDHeaders:
    """The headers MindIE's P requires (mindie-api.md §3.20), each failure a 400 naming it."""
    h = request.headers
    req_id, req_type, d_target = h.get("req-id"), h.get("req-type"), h.get("d-target")
    if req_id is None or req_type is None or d_target is None:
        raise APIError(400, "DMI request must have req-type, req-id, d-target headers")
    if not REQ_ID.fullmatch(req_id):
        raise APIError(400, f"Invalid req-id {req_id[:64]!r}: it must be 1 to 1024 hexadecimal digits "
                            "(the coordinator sends a decimal uint64)", "req-id")
    if req_type != "prefill":
        raise APIError(400, f"Parameter req-type must be prefill but got {req_type[:64]}", "req-type")
    host, sep, port = d_target.partition(";")
    try:
        if not isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address):
            raise ValueError
        d_port = int(port) if sep else None
        if d_port is not None and not 1 <= d_port <= 65535:
            raise ValueError
    except ValueError:
        raise APIError(400, f"Parameter d-target must be an IPv4 address, optionally followed by ;<interCommPort>, "
                            f"got {d_target[:64]!r}", "d-target") from None
    recompute = h.get("is-recompute")
    if recompute not in (None, "true", "false"):
        raise APIError(400, "Parameter is-recompute is an optional parameter, its value must be true or false",
                       "is-recompute")
    return PDHeaders(req_id, host, d_port or own_port, recompute == "true")


def _role_body(body: bytes, v2: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(local instances, peer instances) of a /v1 or /v2 role body; 422 if it is malformed."""
    try:
        raw = json.loads(body)
        local, peers = raw["local"], raw["peers"]
        locals_ = local if v2 else [local]
        if not isinstance(locals_, list) or not locals_ or not isinstance(peers, list):
            raise ValueError
        for item in [*locals_, *peers]:
            if not isinstance(item, dict):
                raise ValueError
            ipaddress.ip_address(item["server_ip"])
            if ("id" in item) != ("host_ip" in item) and not v2:
                raise ValueError  # MindIE: id and host_ip come together
            if not isinstance(item.get("device", []), list):
                raise ValueError
    except (ValueError, KeyError, TypeError):
        raise APIError(422, BAD_ROLE_BODY) from None
    return locals_, peers


async def set_role(ctx: Any, request: Request, body: bytes) -> Response:
    """POST /v1/role/{role} and /v2/role/{role} (management plane)."""
    node = _node(ctx)
    v2 = request.url.path.startswith("/v2/")
    role = request.path_params["role"]
    if role not in (ROLES_V2 if v2 else ROLES_V1):
        raise APIError(404, f"no role {role!r}; one of {list(ROLES_V2 if v2 else ROLES_V1)}", "role")
    node.set_role(role, body, v2)
    return json_response({"result": "OK"})


def _req_id(body: bytes) -> str:
    """The req-id of a {"reqId"} body; 422 if it is not one."""
    try:
        req_id = json.loads(body)["reqId"]
        if not isinstance(req_id, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise APIError(422, "the body must be {\"reqId\": \"<req-id>\"}", "reqId") from None
    return req_id


async def release(ctx: Any, request: Request, body: bytes) -> Response:
    """POST /pd/v1/release {"reqId"} (interCommPort): D is done with the blocks, pulled or not."""
    node = _node(ctx)
    node.check_token(request)
    req_id = _req_id(body)
    return json_response({"reqId": req_id, "released": node.release(req_id)})


async def finished(ctx: Any, request: Request, body: bytes) -> Response:
    """POST /pd/v1/finished {"reqId"} (interCommPort): the request ended on D other than by a
    recompute, so the media P held for one go."""
    node = _node(ctx)
    node.check_token(request)
    req_id = _req_id(body)
    node.held_media.drop(req_id)
    return json_response({"reqId": req_id})


def _node(ctx: Any) -> PDNode:
    if ctx.pd is None:
        raise APIError(400, "this server is not in inferMode dmi (prefill/decode disaggregation)")
    return ctx.pd
