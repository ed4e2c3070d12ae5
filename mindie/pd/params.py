"""The body of `POST /pd/v1/decode`: what P tells D about a request it hands off, as JSON.

It mirrors MindIE's `DecodeParameters` where the meaning is the same (reqId, tokens, firstToken,
msgType, isStream, blockTable, pNodeAddr, metrics) and carries what our D needs to continue a
request exactly as one instance would: the original route and body (D parses them again and gets
the same engine request and renderer), P's first outputs (replayed through that renderer so later
events continue its state), the sampler's seed and cumulative log-probability, the renderer's own
carried fields (an OpenAI `created`), and P's KV location and layout. Nothing here loads torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mindie.engine.request import FinishReason, RequestOutput, TokenLogprob
from mindie.pd.transport import KVHandle, KVLayout
from mindie.server.results import StreamItem


@dataclass(frozen=True)
class DecodeParams:
    req_id: str
    msg_type: str  # the route's path template, e.g. /v2/models/{model}/generate
    path: str  # the path P was asked on
    body: str  # the request body P got, unchanged
    is_stream: bool
    tokens: list[int]  # prompt ids, media expanded as P's model lays them out
    first_token: list[int]  # every output so far: P's first token, after a recompute the earlier ones too
    first_items: list[StreamItem]  # P's outputs, in order, as its renderer saw them
    seed: int
    cumulative_logprob: float
    renderer_state: dict[str, Any]
    kv: KVHandle
    layout: KVLayout
    p_node_addr: str  # "ip:port" of P's interCommPort, for /pd/v1/release
    metrics: dict[str, Any]
    # A prompt's media as MediaInputs.handover_json writes them: D takes their spans in `tokens`,
    # cache keys and rotary delta from here and never fetches, encodes or expands them. None: no media.
    media: dict[str, Any] | None = None

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV P sends: all but the last emitted (a recompute's outputs too)."""
        return self.tokens + self.first_token[:-1]

    def to_json(self) -> dict[str, Any]:
        return {"reqId": self.req_id, "msgType": self.msg_type, "path": self.path, "body": self.body,
                "isStream": self.is_stream, "tokens": self.tokens, "firstToken": self.first_token,
                "firstItems": [item_json(i) for i in self.first_items], "seed": self.seed,
                "cumulativeLogprob": self.cumulative_logprob, "rendererState": self.renderer_state,
                "blockTable": self.kv.block_ids, "kvAddr": self.kv.addr, "layout": dataclasses.asdict(self.layout),
                "pNodeAddr": self.p_node_addr, "metrics": self.metrics,
                **({"media": self.media} if self.media is not None else {})}

    @classmethod
    def from_json(cls, raw: Any) -> DecodeParams:
        """ValueError naming the field if anything is missing or of the wrong type."""
        if not isinstance(raw, dict):
            raise ValueError("the decode request must be a JSON object")

        def get(name: str, kind: type | tuple[type, ...]) -> Any:
            value = raw.get(name)
            if not isinstance(value, kind) or isinstance(value, bool) and kind in (int, (int, float)):
                raise ValueError(f"{name} is missing or not of type {getattr(kind, '__name__', kind)}")
            return value

        def ids(name: str) -> list[int]:
            value = get(name, list)
            if not value or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise ValueError(f"{name} must be a non-empty list of non-negative integers")
            return value

        req_id = get("reqId", str)
        try:
            items = [item_from_json(i) for i in get("firstItems", list)]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"firstItems: {exc}") from None
        if not items:
            raise ValueError("firstItems must not be empty")
        return cls(req_id=req_id, msg_type=get("msgType", str), path=get("path", str), body=get("body", str),
                   is_stream=get("isStream", bool), tokens=ids("tokens"), first_token=ids("firstToken"),
                   first_items=items, seed=get("seed", int), cumulative_logprob=float(get("cumulativeLogprob",
                                                                                          (int, float))),
                   renderer_state=get("rendererState", dict),
                   kv=KVHandle(req_id, get("kvAddr", str), ids("blockTable")),
                   layout=KVLayout.from_json(get("layout", dict)), p_node_addr=get("pNodeAddr", str),
                   metrics=get("metrics", dict), media=get("media", dict) if "media" in raw else None)


def _lp_json(lp: TokenLogprob | None) -> Any:
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _lp_from_json(raw: Any) -> TokenLogprob | None:
    if raw is None:
        return None
    token, logprob, top = raw
    return TokenLogprob(int(token), float(logprob), [(int(t), float(p)) for t, p in top])


def item_json(item: StreamItem) -> dict[str, Any]:
    out = item.output
    fields = dataclasses.asdict(out)
    fields["new_logprobs"] = [_lp_json(lp) for lp in out.new_logprobs]
    fields["prompt_logprobs"] = None if out.prompt_logprobs is None else [_lp_json(lp) for lp in out.prompt_logprobs]
    fields["finish_reason"] = None if out.finish_reason is None else out.finish_reason.value
    fields["kv"] = None  # P's own business
    return {"output": fields, "prefill_ms": item.prefill_ms, "decode_ms": item.decode_ms}


def item_from_json(raw: Any) -> StreamItem:
    fields = dict(raw["output"])
    known = {f.name for f in dataclasses.fields(RequestOutput)}
    if set(fields) != known:
        raise ValueError(f"an output must have exactly the fields {sorted(known)}")
    fields["new_logprobs"] = [_lp_from_json(lp) for lp in fields["new_logprobs"]]
    if fields["prompt_logprobs"] is not None:
        fields["prompt_logprobs"] = [_lp_from_json(lp) for lp in fields["prompt_logprobs"]]
    if fields["finish_reason"] is not None:
        fields["finish_reason"] = FinishReason(fields["finish_reason"])
    return StreamItem(RequestOutput(**fields), raw.get("prefill_ms"), raw.get("decode_ms"))
