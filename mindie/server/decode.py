"""D's side of a disaggregated request: `POST /pd/v1/decode` from P, and `GET /dresult`.

D parses the original body again with the family's own parse, so it holds the same engine request
and renderer as P; it replays P's first outputs through that renderer (discarding the bytes) so
that later events continue the renderer's state exactly (text offsets, a tool-call parser,
OpenAI's `created`, carried from P). It answers P at once; then it reserves blocks (waiting up to
kv_trans_timeout for running requests to free enough), pulls the KV (deadline kv_trans_timeout),
always tells P to release the blocks, and either reports `error:Pull kv failed ...` or resumes the
request and sends each later event as a `data:` record (the last one `lastData:`), or a non-stream
request's whole body as one `lastData:` record. A request the engine preempts is not recomputed
here: it goes back to the coordinator as a `retry:` record holding the request rebuilt for a
prefill node (mindie/pd/recompute.py), after its req-id is free here again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mindie.engine.commands import DropReserved
from mindie.engine.request import Continuation, FinishReason, MediaInputs
from mindie.pd.http import PeerError, post_json
from mindie.pd.params import DecodeParams
from mindie.pd.recompute import RecomputeError, retry_body
from mindie.pd.records import EPOCH_HEADER, KV_TIMEOUT_HEADER, RecordKind, encode
from mindie.pd.transport import PullStatus
from mindie.server.dmi import PDNode
from mindie.server.errors import APIError
from mindie.server.fields import describe
from mindie.server.http import json_response
from mindie.server.protocols.base import Call, Renderer, dumps
from mindie.server.protocols.media import HANDED_OVER, HandedOver
from mindie.server.results import Result, StreamItem
from mindie.server.streams import GenerationTimeout, OutputStream

if TYPE_CHECKING:
    from mindie.engine.request import EngineRequest
    from mindie.server.serving import Serving

log = logging.getLogger("mindie.server.decode")

BLOCK_WAIT_POLL_S = 0.02  # how often a request waiting for free blocks asks again
PULL_FAILED = {PullStatus.FAIL_REVERSIBLE: "Pull kv failed reversibly.",
               PullStatus.FAIL_IRREVERSIBLE: "Pull kv failed irreversibly."}


def _answer(valid: bool, message: str = "", status: int = 200) -> Response:
    return json_response({"isValidDecodeParameters": valid, "errorMessage": message}, status)


async def decode(ctx: Serving, request: Request, body: bytes) -> Response:
    """POST /pd/v1/decode (interCommPort)."""
    node = ctx.pd
    if node is None or not node.is_decode:
        return _answer(False, f"this instance is not a decode node (role {node.role if node else 'none'})", 400)
    try:
        node.check_token(request)
        node.check_peer(request)
    except APIError as exc:
        return _answer(False, exc.message, exc.status)
    try:
        params = DecodeParams.from_json(json.loads(body))
    except ValueError as exc:
        return _answer(False, f"bad decode parameters: {exc}")
    mismatch = node.layout.mismatch(params.layout)
    if mismatch is not None:  # this P can never send us KV: its link fails
        node.link(request.client.host if request.client else "", False)
        return _answer(False, mismatch, 409)
    if params.req_id in ctx.in_flight or params.req_id in node.decoding:
        return _answer(False, f"req-id {params.req_id} is already in use here")
    if node.stopped_early(params.req_id):
        return _answer(False, f"request {params.req_id} was stopped (stopInfer) before it reached this node")
    try:
        engine_request, call, renderer, results = await _rebuild(ctx, node, params)
        ctx.admit()
    except APIError as exc:
        return _answer(False, exc.message)
    except ValidationError as exc:  # P accepted this body: a D configured otherwise may not
        return _answer(False, describe(exc)[0])
    if len(params.kv.block_ids) > ctx.engine.stats.total_blocks:
        return _answer(False, f"Failed forward in for infer engine: the request needs {len(params.kv.block_ids)} KV "
                              f"blocks and this instance has {ctx.engine.stats.total_blocks} in all")
    ctx.in_flight[params.req_id] = None  # stopInfer finds it from now on
    ctx.metrics.received(len(params.tokens))
    node.decoding[params.req_id] = asyncio.ensure_future(
        _run(ctx, node, params, engine_request, call, renderer, results))
    return _answer(True)


async def _reserve(ctx: Serving, node: PDNode, params: DecodeParams) -> list[int] | None:
    """Blocks for the pulled KV. When too few are free, the request waits for running ones to
    finish rather than failing (P's lease, 2 x kv_trans_timeout, covers this wait and the pull):
    None after kv_trans_timeout without them, or once stopped."""
    deadline = time.monotonic() + ctx.settings.kv_trans_timeout_s
    while params.req_id not in node.stopped:
        blocks = await ctx.engine.reserve_kv(params.req_id, params.kv_tokens, len(params.kv_tokens))
        if blocks is not None:
            return blocks
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(BLOCK_WAIT_POLL_S)
    return None


async def _rebuild(ctx: Serving, node: PDNode, params: DecodeParams
                   ) -> tuple[EngineRequest, Call, Renderer, list[Result]]:
    """The request and renderer as P had them after its first outputs."""
    found = node.find_route(params.path)
    if found is None:
        raise APIError(400, f"no generation route matches {params.path}")
    route, path_params = found
    try:
        media = MediaInputs.from_handover_json(params.media) if params.media is not None else None
    except ValueError as exc:
        raise APIError(400, str(exc), "media") from None
    handed_over = HANDED_OVER.set(HandedOver(params.tokens, media))
    try:  # P's prompt and media stand for the body's media parts: nothing is fetched or expanded here
        call, renderer = await route.parse(ctx, params.body.encode(), path_params)
    finally:
        HANDED_OVER.reset(handed_over)
    if len(call.requests) != 1 or call.requests[0].params.num_samples != 1:
        raise APIError(400, "only a single-sample request can be decoded from a prefill node")
    request = dataclasses.replace(
        call.requests[0], request_id=params.req_id, prompt_token_ids=params.tokens, arrival_time=time.monotonic(),
        continuation=Continuation(params.first_token, params.seed, params.cumulative_logprob),
        recompute_elsewhere=True, preempt_at=node.forced_preemption(len(params.first_token)))
    results = [Result.empty(params.req_id, request.params)]
    renderer.replay(params.renderer_state, results, params.first_items, call.stream)
    return request, call, renderer, results


async def _run(ctx: Serving, node: PDNode, params: DecodeParams, request: EngineRequest, call: Call,
               renderer: Renderer, results: list[Result]) -> None:
    req_id = params.req_id
    resumed = False
    retry: list[StreamItem] | None = None
    try:
        blocks = await _reserve(ctx, node, params)
        if blocks is None:
            if req_id not in node.stopped:
                node.dispatcher.push(encode(req_id, RecordKind.ERROR, "Failed forward in for infer engine: no free KV "
                                            f"blocks for the request within {ctx.settings.kv_trans_timeout_s:g} s"))
            await _release(ctx, node, params)
            return
        if len(blocks) != len(params.kv.block_ids):
            raise ValueError(f"{len(blocks)} blocks reserved for P's {len(params.kv.block_ids)}")
        job = node.transport.pull(params.kv, blocks, time.monotonic() + ctx.settings.kv_trans_timeout_s)
        status = await asyncio.to_thread(job.wait)
        p_host = params.p_node_addr.rpartition(":")[0]
        node.link(p_host, status is PullStatus.SUCCESS)
        if status is not PullStatus.SUCCESS:
            log.warning("request %s: pull from %s failed: %s", req_id, params.kv.addr, job.error)
            node.dispatcher.push(encode(req_id, RecordKind.ERROR, PULL_FAILED[status]))  # before the release,
            await _release(ctx, node, params)  # which may wait out its own timeout on the same broken link
            return
        await _release(ctx, node, params)
        if req_id in node.stopped:
            return  # stopped while its KV was on its way: nothing more to say
        first = params.first_items[0].output
        outputs = await ctx.engine.resume_request(request, first.num_cached_prompt_tokens)
        resumed = True
        stream = OutputStream(ctx, request, call, outputs, continued=True)
        retry = await _emit(node, params, call, renderer, results, stream)
    except Exception as exc:  # the request is lost; say so on its stream rather than going silent
        log.exception("request %s failed on the decode node", req_id)
        node.dispatcher.push(encode(req_id, RecordKind.ERROR, f"Failed to decode: {type(exc).__name__}"))
    finally:
        node.decoding.pop(req_id, None)
        node.stopped.discard(req_id)
        if not resumed:
            ctx.engine.submit(DropReserved(req_id))
            ctx.forget(req_id)
        if retry is None and params.media is not None:  # no recompute will need the media P holds
            await _tell_p(ctx, node, params, "/pd/v1/finished")
    if retry is not None:  # only now: the req-id is free here again when the recompute comes back
        log.info("request %s was preempted: sent back for recompute", req_id)
        try:
            record = encode(req_id, RecordKind.RETRY, retry_body(params.msg_type, params.body, params.tokens, retry,
                                                                 renderer.carried()))
        except RecomputeError as exc:  # MindIE: "Try to do recompute but it is not supported."
            record = encode(req_id, RecordKind.ERROR, f"Try to do recompute but it is not supported: {exc}")
        node.dispatcher.push(record)


async def _release(ctx: Serving, node: PDNode, params: DecodeParams) -> None:
    """Tells P it may free the blocks, whether the pull worked or not (P's lease covers a lost
    release)."""
    await _tell_p(ctx, node, params, "/pd/v1/release")


async def _tell_p(ctx: Serving, node: PDNode, params: DecodeParams, path: str) -> None:
    """POSTs {"reqId"} to P's `path`; a failure is only logged: what P holds for the request has
    its own time limit there."""
    host, _, port = params.p_node_addr.rpartition(":")
    try:
        await post_json(host, int(port), path, {"reqId": params.req_id}, node.token,
                        ctx.settings.kv_trans_timeout_s, ctx.settings.host)
    except (PeerError, ValueError) as exc:
        log.warning("request %s: %s to %s failed: %s", params.req_id, path, params.p_node_addr, exc)


async def _emit(node: PDNode, params: DecodeParams, call: Call, renderer: Renderer, results: list[Result],
                stream: OutputStream) -> list[StreamItem] | None:
    """Each event as a record, holding one back so that the last goes out as lastData:. A request
    the engine preempted (FinishReason.RECOMPUTE) ends with every output it emitted, P's first ones
    included, returned for a retry: record."""
    req_id = params.req_id
    emitted = list(params.first_items)
    held: bytes | None = None
    try:
        async for item in stream:
            if item.output.finish_reason is FinishReason.RECOMPUTE:
                if held is not None:
                    node.dispatcher.push(encode(req_id, RecordKind.DATA, held))
                return emitted
            emitted.append(item)
            results[0].add(item)
            if not call.stream:
                continue
            events = renderer.event(0, item, results)
            if item.output.request_done:
                events += renderer.end(results)
            for event in events:
                if held is not None:
                    node.dispatcher.push(encode(req_id, RecordKind.DATA, held))
                held = event
    except (GenerationTimeout, APIError) as exc:
        if held is not None:
            node.dispatcher.push(encode(req_id, RecordKind.DATA, held))
        node.dispatcher.push(encode(req_id, RecordKind.ERROR, str(exc)))
        return None
    finally:
        await stream.aclose()
    last = dumps(renderer.whole(results)).encode() if not call.stream else held or b""
    node.dispatcher.push(encode(req_id, RecordKind.LAST_DATA, last))
    return None


async def dresult(ctx: Serving, request: Request) -> Response:
    """GET /dresult (business plane): the decode node's one record stream."""
    node = ctx.pd
    if node is None:
        raise APIError(400, "Non DMI does not support dresult request")
    if not node.is_decode:
        raise APIError(400, f"Only the Decode node supports dresult but you send to {node.role}")
    return StreamingResponse(node.dispatcher.connect(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", EPOCH_HEADER: node.epoch,
                                      KV_TIMEOUT_HEADER: f"{ctx.settings.kv_trans_timeout_s:g}"})
