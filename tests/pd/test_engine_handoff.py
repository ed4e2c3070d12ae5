"""The engine side of prefill/decode disaggregation without any transport: P stops a handoff
request after its first token with its prompt's blocks pinned, D reserves blocks, the KV is
copied across, and D's resumed request continues exactly as one engine would, greedy and seeded;
every block comes back on both sides. A D that preempts a request sends it back (RECOMPUTE), and
a second P and D continuing it from its outputs so far give the same tokens and text again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import Continuation, EngineRequest, FinishReason, RequestOutput, SamplingParams


def engine(loaded) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=4, max_seq_len=256, max_iter_times=64))


def drain(e: LLMEngine) -> list[RequestOutput]:
    outs = []
    while e.has_unfinished():
        outs += e.step()
        e.blocks.check_invariants()
    return outs


def token_ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(loaded, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """The request's outputs on one engine, never handed off: what every split must reproduce."""
    single = engine(loaded)
    single.add_request(EngineRequest("r", prompt, params))
    return drain(single)


def continuation(outs: list[RequestOutput]) -> Continuation:
    return Continuation(token_ids(outs), outs[-1].seed, outs[-1].cumulative_logprob)


def hand_over(p: LLMEngine, d: LLMEngine, request: EngineRequest, first: RequestOutput,
              emitted: list[RequestOutput]) -> None:
    """D takes over what P handed off: blocks reserved, KV copied, P's lease released, resumed
    after `emitted` (every output so far, P's last one included)."""
    kv_tokens = request.prompt_token_ids + token_ids(emitted)[:-1]
    assert first.kv is not None and first.kv.num_tokens == len(kv_tokens)
    dst = d.handoff.reserve_kv(request.request_id, kv_tokens, len(kv_tokens))
    assert dst is not None and len(dst) == len(first.kv.block_ids)
    src_idx, dst_idx = torch.tensor(first.kv.block_ids), torch.tensor(dst)
    for (pk, pv), (dk, dv) in zip(p.runner.kv_caches, d.runner.kv_caches):
        dk[dst_idx], dv[dst_idx] = pk[src_idx], pv[src_idx]
    p.handoff.release_kv(first.kv.lease_id)
    d.handoff.resume(dataclasses.replace(request, continuation=continuation(emitted)))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=1234, repetition_penalty=1.3,
                   frequency_penalty=0.5, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_handoff_continues_exactly(tiny_llama, params):
    prompt = list(range(3, 3 + 10))  # 10 tokens: 3 blocks of 4, the last partly full
    expected = alone(tiny_llama, prompt, params)

    p, d = engine(tiny_llama), engine(tiny_llama)
    p.add_request(EngineRequest("r", prompt, params, handoff=True))
    [first] = drain(p)
    assert first.finish_reason is None and first.request_done and first.kv is not None
    assert first.new_token_ids == expected[0].new_token_ids and first.kv.num_tokens == len(prompt)
    assert p.blocks.num_used_blocks() == len(first.kv.block_ids) == 3

    hand_over(p, d, EngineRequest("r", prompt, params), first, [first])
    assert p.blocks.num_used_blocks() == 0
    rest = drain(d)
    assert token_ids([first] + rest) == token_ids(expected)
    assert "".join(o.new_text for o in [first] + rest) == "".join(o.new_text for o in expected)
    assert rest[-1].finish_reason == expected[-1].finish_reason and rest[-1].request_done
    assert d.blocks.num_used_blocks() == 0 and not d.handoff.reserved


def test_a_sliding_window_model_hands_off_every_prompt_block(tiny_phi3):
    """P keeps the blocks its window has passed for the export (D reads none of them but gets the
    whole prompt's KV); D then releases them as it decodes, and the tokens are one engine's."""
    prompt = [(7 * i + 3) % 250 for i in range(28)]  # 7 blocks, past the window of 24
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = alone(tiny_phi3, prompt, params)
    p, d = engine(tiny_phi3), engine(tiny_phi3)
    assert p.scheduler.config.window == 24
    p.add_request(EngineRequest("r", prompt, params, handoff=True))
    [first] = drain(p)
    assert first.kv is not None and first.kv.num_tokens == len(prompt) and len(first.kv.block_ids) == 7
    hand_over(p, d, EngineRequest("r", prompt, params), first, [first])
    rest = d.step()
    assert d.blocks.num_released("r#0") == (len(prompt) + 1 - 24 + 1) // 4  # the first step on D released them
    rest += drain(d)
    assert token_ids([first] + rest) == token_ids(expected)
    assert d.blocks.num_used_blocks() == 0 and p.blocks.num_used_blocks() == 0


def test_handoff_that_ends_at_its_first_token_keeps_nothing(tiny_llama):
    p = engine(tiny_llama)
    p.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0), handoff=True))
    [out] = drain(p)
    assert out.finish_reason is not None and out.kv is None and p.blocks.num_used_blocks() == 0


def test_a_held_lease_keeps_its_request_id(tiny_llama):
    p = engine(tiny_llama)
    p.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0), handoff=True))
    [out] = drain(p)
    with pytest.raises(ValueError, match="still has KV blocks held"):
        p.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4), handoff=True))
    p.handoff.release_kv(out.kv.lease_id)
    p.handoff.release_kv(out.kv.lease_id)  # idempotent
    assert p.blocks.num_used_blocks() == 0


def test_reservation_refused_or_dropped(tiny_llama):
    d = engine(tiny_llama)
    assert d.handoff.reserve_kv("big", list(range(200)), 200) is None  # 50 blocks > 32
    assert d.handoff.reserve_kv("r", [1, 2, 3], 3) is not None
    with pytest.raises(ValueError, match="already in use"):
        d.handoff.reserve_kv("r", [1, 2, 3], 3)
    d.handoff.drop_reserved("r")
    assert d.blocks.num_used_blocks() == 0
    with pytest.raises(ValueError, match="no reserved KV"):
        d.handoff.resume(EngineRequest("r", [1, 2, 3], SamplingParams(), continuation=Continuation([4], 0, 0.0)))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, stop=["zz"]),
    SamplingParams(max_tokens=14, temperature=0.9, top_k=20, seed=99, presence_penalty=0.7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_request_sent_back_for_recompute_continues_exactly(tiny_llama, params):
    prompt = list(range(7, 7 + 9))
    expected = alone(tiny_llama, prompt, params)

    p1, d1 = engine(tiny_llama), engine(tiny_llama)
    p1.add_request(EngineRequest("r", prompt, params, handoff=True))
    [first] = drain(p1)
    hand_over(p1, d1, EngineRequest("r", prompt, params, recompute_elsewhere=True, preempt_at=5), first, [first])
    sent_back = drain(d1)
    emitted, last = [first, *sent_back[:-1]], sent_back[-1]
    assert last.finish_reason is FinishReason.RECOMPUTE and last.request_done and not last.new_token_ids
    assert len(token_ids(emitted)) == 5 and d1.blocks.num_used_blocks() == 0 and not d1.requests

    # P recomputes the prompt and the outputs so far, samples one more token and hands off again
    p2, d2 = engine(tiny_llama), engine(tiny_llama)
    again = EngineRequest("r", prompt, params, handoff=True, continuation=continuation(emitted))
    p2.add_request(again)
    [resumed] = drain(p2)
    assert resumed.kv is not None and resumed.kv.num_tokens == len(prompt) + 5
    assert resumed.num_output_tokens == 6 and resumed.first_token_latency_s is None
    emitted.append(resumed)
    hand_over(p2, d2, EngineRequest("r", prompt, params), resumed, emitted)
    rest = drain(d2)
    assert token_ids(emitted + rest) == token_ids(expected)
    assert "".join(o.new_text for o in emitted + rest) == "".join(o.new_text for o in expected)
    assert rest[-1].finish_reason == expected[-1].finish_reason
    assert [e.blocks.num_used_blocks() for e in (p2, d2)] == [0, 0]


def test_a_continuation_must_leave_room_and_use_known_tokens(tiny_llama):
    e = engine(tiny_llama)
    with pytest.raises(ValueError, match="no room left"):
        e.add_request(EngineRequest("r", [5, 6], SamplingParams(max_tokens=3),
                                    continuation=Continuation([7, 8, 9], 0, 0.0)))
    with pytest.raises(ValueError, match="out of range"):
        e.add_request(EngineRequest("r", [5, 6], SamplingParams(max_tokens=8),
                                    continuation=Continuation([10**6], 0, 0.0)))


def test_a_d_short_of_blocks_sends_the_newest_request_back(tiny_llama):
    """No test hook: two resumed requests outgrow D's pool; the scheduler preempts the newer one,
    which ends with RECOMPUTE (its blocks freed) instead of being recomputed on D."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    p = engine(tiny_llama)
    d = LLMEngine(tiny_llama, EngineConfig(num_kv_blocks=12, block_size=4, max_seq_len=256, max_iter_times=64))
    for rid, prompt in (("old", list(range(3, 11))), ("new", list(range(20, 28)))):
        request = EngineRequest(rid, prompt, params, handoff=True)
        p.add_request(request)
        [first] = drain(p)
        hand_over(p, d, dataclasses.replace(request, handoff=False, recompute_elsewhere=True), first, [first])
    outs = drain(d)
    sent_back = [o for o in outs if o.finish_reason is FinishReason.RECOMPUTE]
    assert [o.request_id for o in sent_back] == ["new"] and sent_back[0].request_done
    assert [o.finish_reason for o in outs if o.request_id == "old"][-1] is FinishReason.LENGTH
    assert d.blocks.num_used_blocks() == 0 and d.stats().num_preemptions == 1
