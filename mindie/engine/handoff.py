"""Prefill/decode disaggregation inside one engine: handing a request's KV to another engine, and
taking one over from another.

P: a `handoff` request stops after its first token with its prompt's blocks pinned under a lease
(`KVHandoff.export`); `release_kv` drops the lease once D has pulled them or the lease expired.
D: `reserve_kv` takes fresh blocks for the incoming KV (not registered in the prefix cache until
they hold it), the transport writes them, and `resume` turns them into a running sequence that
continues from the first token exactly as P's would have; `drop_reserved` gives them back when the
pull failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mindie.engine.block_manager import BlockManager
from mindie.engine.detokenizer import IncrementalDetokenizer
from mindie.engine.request import EngineRequest, KVExport
from mindie.engine.scheduler import Scheduler
from mindie.engine.sequence import Sequence
from mindie.tokenizer import Tokenizer

LEASE_PREFIX = "pd-lease:"  # block-table ids of P's pinned exports, apart from any sequence's


def _seq_id(request_id: str) -> str:
    return f"{request_id}#0"


def continued_sequence(request: EngineRequest, max_total: int, tokenizer: Tokenizer, vocab_size: int) -> Sequence:
    """The one sample of a request that goes on after `request.continuation`'s outputs: the
    detokenizer and grammar matcher replayed over them one by one, as if it had sampled them.
    ValueError if the request cannot continue."""
    cont = request.continuation
    assert cont is not None
    params = request.params
    if params.use_beam_search or params.num_samples != 1:
        raise ValueError("only a single-sample request can continue after outputs made elsewhere")
    if not cont.output_token_ids:
        raise ValueError("a continued request needs at least one output")
    bad = next((t for t in cont.output_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"output token id {bad} is out of range [0, {vocab_size})")
    if len(request.prompt_token_ids) + len(cont.output_token_ids) >= max_total:
        raise ValueError("the request has no room left for output here")
    detok = IncrementalDetokenizer.for_request(tokenizer, request)
    matcher = request.grammar.matcher() if request.grammar is not None else None
    for token in cont.output_token_ids:
        detok.append([token])
        if matcher is not None:
            matcher.advance(token)
    seq = Sequence(request, 0, cont.seed, max_total, detok, matcher=matcher,
                   token_ids=list(request.prompt_token_ids) + list(cont.output_token_ids))
    seq.cumulative_logprob = cont.cumulative_logprob
    return seq


class KVHandoff:
    """The engine's side of PD: P's leases on exported blocks, D's reservations for incoming KV.
    `requests` is the engine's map of running requests (shared); `max_total` is the engine's
    prompt + output bound for a request of a given beam width (ValueError if it leaves no room)."""

    def __init__(self, blocks: BlockManager, scheduler: Scheduler, requests: dict[str, list[Sequence]],
                 tokenizer: Tokenizer, vocab_size: int, max_total: Callable[[EngineRequest, int], int]) -> None:
        self.blocks = blocks
        self.scheduler = scheduler
        self.requests = requests
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_total = max_total
        self.reserved: set[str] = set()  # D: request ids holding blocks for KV being pulled

    # --- P ---------------------------------------------------------------------------------------

    def holds_lease(self, request_id: str) -> bool:
        return self.blocks.has(LEASE_PREFIX + request_id)

    def export(self, seq: Sequence) -> KVExport:
        """Ends a handoff sequence after its first token: its blocks stay pinned under a lease,
        the sequence leaves the scheduler and the engine's requests."""
        lease_id = LEASE_PREFIX + seq.request.request_id
        self.blocks.fork(seq.seq_id, lease_id)  # the lease holds the blocks once the sequence lets go
        export = KVExport(lease_id, self.blocks.block_table(lease_id), seq.num_computed_tokens)
        self.scheduler.remove(seq)
        del self.requests[seq.request.request_id]
        return export

    def release_kv(self, lease_id: str) -> None:
        """Frees the blocks pinned under a lease; unknown (already released) leases are ignored."""
        if lease_id.startswith(LEASE_PREFIX) and self.blocks.has(lease_id):
            self.blocks.free(lease_id)

    # --- D ---------------------------------------------------------------------------------------

    def reserve_kv(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int] | None:
        """Fresh blocks for positions [0, num_tokens) of request_id's only sample, in order; None if
        the pool has too few now. ValueError if the id is in use."""
        seq_id = _seq_id(request_id)
        if request_id in self.requests or self.blocks.has(seq_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.blocks.allocate(seq_id, token_ids, num_tokens, reuse_prefix=False) is None:
            return None
        self.reserved.add(request_id)
        return self.blocks.block_table(seq_id)

    def drop_reserved(self, request_id: str) -> None:
        if request_id in self.reserved:
            self.reserved.discard(request_id)
            self.blocks.free(_seq_id(request_id))

    def resume(self, request: EngineRequest, num_cached_prompt_tokens: int = 0) -> None:
        """Runs a request handed off by P: its `continuation` holds the outputs emitted so far and
        its reserved blocks the KV of every token before the last of them (the prompt, and any
        outputs a recompute went over). ValueError (the reservation dropped) if it cannot run here."""
        rid = request.request_id
        if rid not in self.reserved:
            raise ValueError(f"request {rid!r} has no reserved KV blocks")
        try:
            if request.continuation is None:
                raise ValueError("a resumed request needs the outputs it continues after")
            seq = continued_sequence(request, self.max_total(request, 1), self.tokenizer, self.vocab_size)
        except ValueError:
            self.drop_reserved(rid)
            raise
        self.reserved.discard(rid)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.num_cached_prompt_tokens = num_cached_prompt_tokens  # P's prefix-cache hit, reported as is
        seq.first_scheduled_time = seq.first_token_time = seq.ready_time = time.monotonic()
        self.blocks.commit(seq.seq_id, seq.cache_keys, seq.num_computed_tokens)  # image blocks by content
        self.requests[rid] = [seq]
        self.scheduler.resume(seq)
