"""Requests that a PD cluster and one mixed instance must answer alike, greedy, one per family
(native `/infer`, vLLM `/generate`, OpenAI chat, Triton generate) and stream or not, and the
answers reduced to what must match: the events, less what differs between any two runs."""

from __future__ import annotations

import json
import re
from typing import Any

# what differs between two runs of one request anyway (ids, clocks, timings), and the prefix-cache hits,
# which depend on what each instance served before
PER_REQUEST = {"id", "created", "seed", "queue_wait_time", "prefill_time", "decode_time", "prefillTime",
               "decodeTime", "batch_size", "cached_tokens"}
GREEDY = {"do_sample": False, "max_new_tokens": 6}
CHAT = [{"role": "user", "content": "hi"}]
# (path, body, stream) for a model served as "tiny"
CASES = [(path, {**body, **({"stream": stream} if "/v2/" not in path else {})}, stream)
         for stream in (False, True) for path, body in (
             ("/infer", {"inputs": "hello world", "parameters": GREEDY}),
             ("/generate", {"prompt": "the cat", "max_tokens": 6, "temperature": 0}),
             ("/v1/chat/completions", {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": CHAT}),
             ("/v2/models/tiny/generate_stream" if stream else "/v2/models/tiny/generate",
              {"text_input": "hi there", "parameters": GREEDY}))]


def normal(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: normal(v) for k, v in obj.items() if k not in PER_REQUEST}
    return [normal(v) for v in obj] if isinstance(obj, list) else obj


def events(raw: bytes, path: str, stream: bool) -> list[Any]:
    """A body as its events (one for a non-stream answer), each normalised."""
    if not stream:
        return [normal(json.loads(raw))]
    if path == "/generate":
        return [normal(json.loads(e)) for e in raw.split(b"\0") if e]
    payloads = [e[5:].strip() for e in re.split(rb"\n\n", raw) if e]
    return [p.decode() if p == b"[DONE]" else normal(json.loads(p)) for p in payloads]
