"""P's side of a disaggregated request: every inference route, on a prefill node.

The family's own parse runs as on one instance; the request runs to its first token and the
family's renderer renders what a single instance would have streamed so far. If the request
ended there (one token, EOS, a stop) P answers the whole result and nothing goes to D. Otherwise
the engine has pinned the prompt's KV blocks (`RequestOutput.kv`); P publishes them on its KV
transport under the req-id, holds them under a lease, tells D everything it needs to continue
(`POST /pd/v1/decode`), and only once D has accepted answers the coordinator:
`{"reqId", "isStream": true, "isLastResp": false, "output": "<events>"}`, or for a non-stream
request `{"reqId", "isStream": false}`.

A call P cannot hand off as one sequence (several prompts, n or best_of > 1, beam search) runs to
its end on P and is answered whole, as one that ended at its first token.

With `is-recompute: true` the body is one a decode node sent back after preempting the request
(mindie/pd/recompute.py): P parses the client's original body, takes the prompt and output ids the
decode node held, brings its renderer to where that node's stood, computes the KV of all of them
and samples one more token; its reply carries only that token's events (the client has the rest),
and D is told every output so far.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from mindie.engine.request import Continuation
from mindie.pd.http import PeerError, post_json
from mindie.pd.media import MediaGone, redact
from mindie.pd.params import DecodeParams
from mindie.pd.recompute import Recompute, RecomputeError, read_retry
from mindie.server.dmi import PDNode, parse_headers
from mindie.server.errors import APIError
from mindie.server.http import json_response
from mindie.server.protocols.base import Call, Renderer, dumps
from mindie.server.results import Result, StreamItem
from mindie.server.streams import merge

if TYPE_CHECKING:
    from mindie.server.protocols.family import Parse
    from mindie.server.serving import Serving

log = logging.getLogger("mindie.server.prefill")


def _can_hand_off(call: Call) -> bool:
    if len(call.requests) != 1:
        return False
    params = call.requests[0].params
    return params.num_samples == 1 and not params.use_beam_search


async def prefill(ctx: Serving, request: Request, body: bytes, parse: Parse) -> Response:
    node = ctx.pd
    assert node is not None
    node.check_inference()
    headers = parse_headers(request, ctx.settings.inter_comm_port)
    if headers.d_host not in node.peers:
        raise APIError(400, f"Parameter d-target {headers.d_host} is not a decode peer of this instance "
                            "(see /v1/role)", "d-target")
    if headers.req_id in node.leases:
        raise APIError(400, f"req-id {headers.req_id} is already in use: its KV is still held for a decode node",
                       "req-id")
    route = node.find_route(request.url.path)
    template = route[0].template if route else request.url.path
    recompute = _read_recompute(template, body) if headers.recompute else None
    if recompute is not None:
        body = _restore_media(node, headers.req_id, recompute.body)
    call, renderer = await parse(ctx, body, request.path_params)
    try:
        text, has_media = redact(body)  # D gets the body as a JSON string, its media named, not sent
    except UnicodeDecodeError:
        raise APIError(422, "the request body must be UTF-8 on a prefill node") from None
    replayed: list[Result] = []
    before: list[StreamItem] = []  # outputs emitted before a recompute, rendered already
    if recompute is not None:
        call = _continue(call, recompute)
        replayed = [Result.empty(headers.req_id, call.requests[0].params)]
        renderer.replay(recompute.renderer_state, replayed, recompute.items, call.stream)
        before = recompute.items
    elif _can_hand_off(call):
        call = dataclasses.replace(call, requests=[dataclasses.replace(call.requests[0], handoff=True)])
    started = time.time()
    streams = await ctx.start(call, request_id=headers.req_id)
    results = replayed or [Result.empty(s.request_id, s.request.params) for s in streams]
    items: list[tuple[int, StreamItem]] = []
    try:
        async for k, item in merge(streams):
            results[k].add(item)
            items.append((k, item))
    finally:
        for s in streams:
            await s.aclose()
    begin = recompute is None  # a recompute's stream began long ago
    export = items[-1][1].output.kv
    if export is None:
        node.held_media.drop(headers.req_id)  # a recompute that ended here: no D will send it back
        return _envelope(headers.req_id, call.stream, _whole(call, renderer, results, items, begin), last=True)
    # The request goes on at D: to its renderers (here and there) this output is not its last.
    k, last = items[-1]
    items[-1] = (k, dataclasses.replace(last, output=dataclasses.replace(last.output, request_done=False, kv=None)))
    output = _events(renderer, results, items, begin) if call.stream else None
    handle = node.transport.publish(headers.req_id, export.block_ids)
    node.hold(headers.req_id, export.lease_id)
    if has_media:  # before D has it: a recompute D sends back reads the media from here
        node.held_media.hold(headers.req_id, body)
    first_items = before + [i for _, i in items]
    item = items[-1][1]
    params = DecodeParams(
        req_id=headers.req_id, msg_type=template, path=request.url.path,
        body=text, is_stream=call.stream, tokens=call.requests[0].prompt_token_ids,
        first_token=[t for i in first_items for t in i.output.new_token_ids], first_items=first_items,
        seed=item.output.seed, cumulative_logprob=item.output.cumulative_logprob,
        renderer_state=renderer.carried(), kv=handle, layout=node.layout,
        p_node_addr=f"{ctx.settings.host}:{ctx.settings.inter_comm_port}",
        metrics={"firstTokenCost": items[0][1].prefill_ms, "e2eStartTime": started},
        media=call.requests[0].media.handover_json() if call.requests[0].media is not None else None)
    try:
        status, reply = await post_json(headers.d_host, headers.d_port, "/pd/v1/decode", params.to_json(),
                                        node.token, ctx.settings.kv_trans_timeout_s, ctx.settings.host)
    except PeerError as exc:
        node.release(headers.req_id)
        node.held_media.drop(headers.req_id)
        node.link(headers.d_host, False)
        log.warning("request %s: decode call to %s:%s failed: %s", headers.req_id, headers.d_host, headers.d_port, exc)
        raise APIError(500, f"[P Node] Send D request failed:{exc}") from None
    if status != 200 or not isinstance(reply, dict) or reply.get("isValidDecodeParameters") is not True:
        node.release(headers.req_id)
        node.held_media.drop(headers.req_id)
        if status in (401, 403, 409):  # token, peer list or KV layout: D refuses every request from here
            node.link(headers.d_host, False)
        why = reply.get("errorMessage") if isinstance(reply, dict) else None
        raise APIError(500, f"[P Node] Send D request failed:{why or f'D answered HTTP {status}'}")
    node.link(headers.d_host, True)
    return _envelope(headers.req_id, call.stream, output, last=False)


def _read_recompute(template: str, body: bytes) -> Recompute:
    try:
        return read_retry(template, body)
    except RecomputeError as exc:
        raise APIError(400, f"is-recompute: {exc}", "is-recompute") from None


def _restore_media(node: PDNode, req_id: str, body: bytes) -> bytes:
    """The client's body behind a recompute's: its media as the client sent them. 410 naming
    is-recompute when this node no longer holds them (a coordinator gives up on it at once)."""
    try:
        return node.held_media.restore(req_id, body)
    except MediaGone as exc:
        raise APIError(410, f"is-recompute: {exc}", "is-recompute") from None


def _continue(call: Call, recompute: Recompute) -> Call:
    """The call's one request, going on after the outputs a decode node sent back: its prompt the
    ids the decode node held (not the body tokenized again), handed off again after one token."""
    if not _can_hand_off(call):
        raise APIError(400, "is-recompute: only a single-sample request can be recomputed", "is-recompute")
    if not recompute.items:
        raise APIError(400, "is-recompute: the request has no outputs to continue after", "is-recompute")
    last = recompute.items[-1].output
    request = dataclasses.replace(call.requests[0], prompt_token_ids=recompute.prompt, handoff=True,
                                  continuation=Continuation(recompute.outputs, last.seed, last.cumulative_logprob))
    return dataclasses.replace(call, requests=[request])


def _events(renderer: Renderer, results: list[Result], items: list[tuple[int, StreamItem]], begin: bool) -> str:
    chunks = list(renderer.begin(results)) if begin else []
    for k, item in items:
        chunks += renderer.event(k, item, results)
    return b"".join(chunks).decode()


def _whole(call: Call, renderer: Renderer, results: list[Result], items: list[tuple[int, StreamItem]],
           begin: bool) -> str:
    if call.stream:
        return _events(renderer, results, items, begin) + b"".join(renderer.end(results)).decode()
    return dumps(renderer.whole(results))


def _envelope(req_id: str, stream: bool, output: str | None, last: bool) -> Response:
    body: Mapping[str, Any] = {"reqId": req_id, "isStream": stream}
    if stream or last:
        body = {**body, "isLastResp": last, "output": output or ""}
    return json_response(body)
