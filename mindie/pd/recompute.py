"""The body a decode node sends back (`retry:`) when it preempts a request, and what a prefill node
reads from it under `is-recompute: true` (pd-disaggregation.md A.6, C.3).

MindIE's D rebuilds the request in its family's own body with the input field replaced by the
string "N,p1,...,pN,o1,...,oM": the N prompt ids, then the ids generated so far. Ours does the
same, and adds one field the family bodies do not have, `mindieContinuation`: the original body
(so P parses exactly the request the client sent: chat template, echo, tools), every output item
emitted so far and the renderer's carried state (so P and the next D render the rest of the
response as if it had never stopped: offsets, logprobs, a tool-call parser). P takes the token
ids from the input field and checks them against the items. Nothing here loads torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mindie.pd.params import item_from_json, item_json
from mindie.server.results import StreamItem

CONTINUATION_KEY = "mindieContinuation"
MAX_IDS = 4 * 2**20  # ids in one recompute input, the bound on token inputs of the API routes


class RecomputeError(ValueError):
    """A recompute body P cannot continue; the message names what is wrong."""


def ids_input(prompt: list[int], outputs: list[int]) -> str:
    return ",".join(map(str, [len(prompt), *prompt, *outputs]))


def parse_ids_input(text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of "N,p1,...,pN,o1,...,oM"."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise RecomputeError("the recompute input must be comma-separated integers N,p1..pN,o1..oM") from None
    if len(values) > MAX_IDS + 1 or any(v < 0 for v in values):
        raise RecomputeError(f"the recompute input must hold at most {MAX_IDS} non-negative ids")
    n = values[0]
    if not 1 <= n < len(values) - 1:
        raise RecomputeError(f"the recompute input's N ({n}) must leave at least one prompt and one output id")
    return values[1 : n + 1], values[n + 1 :]


# Each generation route's input field, by the route's path template (MindIE's per-family
# dmiReCompBuildMethod_); /generate is vLLM's `prompt` or TGI's `inputs`, Triton's tensor route
# takes it in inputs[0].data.
_INPUT_KEY = {"/infer": "inputs", "/infer_token": "inputs", "/generate_stream": "inputs", "/": "inputs",
              "/v1/chat/completions": "messages", "/v1/completions": "prompt",
              "/v2/models/{model}/generate": "text_input", "/v2/models/{model}/generate_stream": "text_input"}
TRITON_TENSORS = "/v2/models/{model}/infer"


def _input_slot(template: str, body: Any) -> tuple[dict[str, Any], str]:
    """(the object, the key) holding the route's input in `body`."""
    if not isinstance(body, dict):
        raise RecomputeError("the recompute body must be a JSON object")
    if template == TRITON_TENSORS:
        tensors = body.get("inputs")
        if not (isinstance(tensors, list) and tensors and isinstance(tensors[0], dict)):
            raise RecomputeError("the recompute body needs inputs[0] (a tensor object)")
        return tensors[0], "data"
    if template == "/generate":
        return body, "prompt" if "prompt" in body else "inputs"
    if template not in _INPUT_KEY:
        raise RecomputeError(f"{template} is not a generation route")
    return body, _INPUT_KEY[template]


def retry_body(template: str, original: str, prompt: list[int], items: list[StreamItem],
               renderer_state: dict[str, Any]) -> bytes:
    """The `retry:` record's body for a request of route `template` whose client sent `original`."""
    body = json.loads(original)
    outputs = [t for item in items for t in item.output.new_token_ids]
    if template in ("/infer", "/infer_token"):
        body.pop("input_id", None)  # /infer_token's ids: the recompute input replaces them
    slot, key = _input_slot(template, body)
    slot[key] = ids_input(prompt, outputs)
    body[CONTINUATION_KEY] = {"body": original, "items": [item_json(i) for i in items],
                              "rendererState": renderer_state}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Recompute:
    body: bytes  # what the client sent
    prompt: list[int]
    items: list[StreamItem]  # every output emitted so far, in order
    renderer_state: dict[str, Any]

    @property
    def outputs(self) -> list[int]:
        return [t for item in self.items for t in item.output.new_token_ids]


def read_retry(template: str, raw: bytes) -> Recompute:
    """What P needs from a recompute body; RecomputeError if it is not one our decode nodes send."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RecomputeError("the recompute body is not JSON") from None
    cont = body.get(CONTINUATION_KEY) if isinstance(body, dict) else None
    if not isinstance(cont, dict):
        raise RecomputeError(f"a recompute body needs the {CONTINUATION_KEY} field this server's decode nodes add")
    original, items, renderer_state = cont.get("body"), cont.get("items"), cont.get("rendererState")
    if not isinstance(original, str) or not isinstance(items, list) or not isinstance(renderer_state, dict):
        raise RecomputeError(f"{CONTINUATION_KEY} needs body (string), items (list) and rendererState (object)")
    try:
        parsed_items = [item_from_json(i) for i in items]
    except (KeyError, TypeError, ValueError) as exc:
        raise RecomputeError(f"{CONTINUATION_KEY}.items: {exc}") from None
    slot, key = _input_slot(template, body)
    if not isinstance(slot.get(key), str):
        raise RecomputeError(f"the recompute input ({key}) must be a string N,p1..pN,o1..oM")
    prompt, outputs = parse_ids_input(slot[key])
    recompute = Recompute(original.encode(), prompt, parsed_items, renderer_state)
    if recompute.outputs != outputs:
        raise RecomputeError(f"the recompute input's outputs differ from the tokens of {CONTINUATION_KEY}.items")
    return recompute
