"""The engine end to end on a tiny random Llama: greedy parity with transformers under every
scheduling situation (batching, chunked prefill, prefix hits, preemption), seeded sampling,
finish reasons and abort."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import hf_greedy

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, FinishReason, RequestOutput, SamplingParams

NEW = 24


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def prompts(n: int, seed: int = 3, max_len: int = 39) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, max_len + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def run(engine: LLMEngine, reqs: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    """Runs to completion, checking the block invariant after every step; every request's
    state and every block is gone at the end."""
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
        engine.blocks.check_invariants()
    assert not engine.has_unfinished() and not engine.requests and not engine.beams.searches
    assert engine.blocks.num_used_blocks() == 0
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def make_engine(loaded, **keys) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig.from_mindie({"maxSeqLen": 256, "maxIterTimes": 64, **keys}))


@pytest.mark.parametrize(
    "config",
    [
        dict(cacheBlockSize=4),  # plain batch of mixed lengths
        dict(cacheBlockSize=4, maxPrefillTokens=7),  # chunked prefill, decodes interleaved
        dict(cacheBlockSize=4, prefillChunkSize=9),  # the same, by the step budget under maxPrefillTokens
        dict(cacheBlockSize=8, numKvBlocks=14, maxPrefillTokens=64),  # too few blocks: preemption
        # batch limits; a pool sized to the test, as check_invariants walks every block after each step
        dict(cacheBlockSize=1, numKvBlocks=1024, maxBatchSize=2, maxPrefillBatchSize=1),
    ],
)
def test_greedy_matches_transformers(tiny_llama, hf, config):
    engine = make_engine(tiny_llama, **config)
    ps = prompts(6)
    outs = run(engine, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        want, want_lp = hf_greedy(hf, p, NEW)
        assert tokens(outs[str(i)]) == want
        got_lp = [lp.logprob for o in outs[str(i)] for lp in o.new_logprobs]
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-3
        assert outs[str(i)][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("keys, budget", [
    ({}, 512),  # unset: DEFAULT_STEP_TOKENS
    ({"maxPrefillTokens": 300}, 300),  # ... at most maxPrefillTokens
    ({"prefillChunkSize": 100}, 100),
])
def test_a_step_computes_at_most_its_budget_and_output_is_unchanged(tiny_llama, keys, budget):
    """A burst of prompts is spread over full steps of the budget, decodes riding along, and every
    request's tokens are those of one step taking all the prompts at once."""
    ps = prompts(60, seed=5, max_len=60)
    assert sum(map(len, ps)) > 2 * budget
    whole = make_engine(tiny_llama, cacheBlockSize=4, numKvBlocks=1500, prefillChunkSize=8192)
    want = run(whole, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(ps)])
    engine = make_engine(tiny_llama, cacheBlockSize=4, numKvBlocks=1500, **keys)
    sizes = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        sizes.append(out.num_tokens)
        return out

    engine.scheduler.schedule = spy
    got = run(engine, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(ps)])
    assert max(sizes) <= budget and sizes[0] >= budget - 1  # a prompt is never left one token
    assert sum(s >= budget - 1 for s in sizes) >= 2
    assert {k: tokens(v) for k, v in got.items()} == {k: tokens(v) for k, v in want.items()}


def test_preemption_happened_and_output_is_unchanged(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=8, numKvBlocks=12)
    alone = {i: tokens(run(engine, [EngineRequest(f"a{i}", p, GREEDY)])[f"a{i}"]) for i, p in enumerate(prompts(5))}
    preempted = []
    original = engine.scheduler.preempt

    def spy(seq):
        preempted.append(seq.seq_id)
        original(seq)

    engine.scheduler.preempt = spy
    outs = run(engine, [EngineRequest(str(i), p, GREEDY) for i, p in enumerate(prompts(5))])
    assert preempted, "the pool was meant to be too small for all five at once"
    assert {int(k): tokens(v) for k, v in outs.items()} == alone


def test_prefix_cache_hit_skips_work_and_keeps_output(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=4)
    shared = prompts(1)[0] + list(range(30))
    first = run(engine, [EngineRequest("first", shared, GREEDY)])["first"]
    second = run(engine, [EngineRequest("second", shared, GREEDY)])["second"]
    assert tokens(first) == tokens(second)
    assert second[-1].num_cached_prompt_tokens == (len(shared) - 1) // 4 * 4 > 0


def test_seeded_sampling_is_batch_invariant(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=4)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True,
                            repetition_penalty=1.2, frequency_penalty=0.5)
    target = prompts(1, seed=9)[0]
    alone = tokens(run(engine, [EngineRequest("t", target, params)])["t"])
    others = [EngineRequest(f"o{i}", p, SamplingParams(max_tokens=10, temperature=0.7, seed=i))
              for i, p in enumerate(prompts(31, seed=5))]
    for position in (0, 17, 31):
        batch = others[:position] + [EngineRequest("t", target, params)] + others[position:]
        assert tokens(run(engine, batch)["t"]) == alone
    different = tokens(run(engine, [EngineRequest("d", target, SamplingParams(
        max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True))])["d"])
    assert different != alone


def test_finish_reasons(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=4)
    p = prompts(1)[0]
    greedy = tokens(run(engine, [EngineRequest("g", p, GREEDY)])["g"])
    stop_tok = greedy[5]
    out = run(engine, [EngineRequest("s", p, SamplingParams(max_tokens=NEW, temperature=0,
                                                            stop_token_ids=(stop_tok,)))])["s"]
    assert out[-1].finish_reason is FinishReason.EOS and tokens(out) == greedy[: greedy.index(stop_tok) + 1]
    out = run(engine, [EngineRequest("l", p, SamplingParams(max_tokens=3, temperature=0))])["l"]
    assert out[-1].finish_reason is FinishReason.LENGTH and len(tokens(out)) == 3
    text = engine.tokenizer.decode(greedy)
    stop = text[4:7]
    if stop:
        out = run(engine, [EngineRequest("t", p, SamplingParams(max_tokens=NEW, temperature=0, stop=(stop,)))])["t"]
        joined = "".join(o.new_text for o in out)
        assert out[-1].finish_reason is FinishReason.STOP and joined == text[: text.index(stop)]


def test_abort_in_every_phase_frees_blocks(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=4, maxPrefillTokens=5, maxBatchSize=1)
    long_prompt = list(range(40))
    engine.add_request(EngineRequest("prefilling", long_prompt, GREEDY))
    engine.add_request(EngineRequest("queued", long_prompt, GREEDY))
    engine.step()  # first chunk of "prefilling"; "queued" waits (maxBatchSize=1)
    assert engine.blocks.num_used_blocks() > 0
    assert engine.abort("queued")[0].finish_reason is FinishReason.ABORT
    assert engine.abort("prefilling")[0].finish_reason is FinishReason.ABORT
    assert engine.blocks.num_used_blocks() == 0
    engine.add_request(EngineRequest("decoding", [1, 2, 3], GREEDY))
    for _ in range(4):
        engine.step()
    assert engine.abort("decoding")[0].num_output_tokens >= 2
    assert engine.abort("missing") == []
    assert not engine.has_unfinished() and engine.blocks.num_used_blocks() == 0
    engine.blocks.check_invariants()


def test_bad_requests_raise(tiny_llama):
    engine = make_engine(tiny_llama, cacheBlockSize=4, maxSeqLen=64, maxInputTokenLen=32, maxIterTimes=16)
    with pytest.raises(ValueError, match="maxInputTokenLen"):
        engine.add_request(EngineRequest("long", list(range(40)), GREEDY))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request(EngineRequest("vocab", [10_000], GREEDY))
    engine.add_request(EngineRequest("dup", [1], GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("dup", [1], GREEDY))
    for kwargs, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(logprobs=21), "logprobs"), (dict(max_tokens=0), "max_tokens"),
                          (dict(presence_penalty=3), "presence_penalty"), (dict(stop=("x",) * 1025), "stop"),
                          (dict(stop=("x" * 32769,)), "stop"), (dict(n=129), "n"),
                          (dict(stop_token_ids=tuple(range(1025))), "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="priority"):
        EngineRequest("p", [1], GREEDY, priority=6)
    with pytest.raises(ValueError, match="cacheBlockSize"):
        EngineConfig.from_mindie({"cacheBlockSize": 0})
    with pytest.raises(ValueError, match="unknown"):
        EngineConfig.from_mindie({"cacheBlocksize": 16})


def test_n_samples_share_the_prompt_and_reproduce(tiny_llama):
    prompt = list(range(50, 90))  # 40 tokens: 10 full blocks of 4 to share

    def run_n() -> tuple[list[list[int]], list[RequestOutput]]:
        engine = make_engine(tiny_llama, cacheBlockSize=4)
        params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
        outs = run(engine, [EngineRequest("r", prompt, params)])["r"]
        by_index: dict[int, list[int]] = {}
        for o in outs:
            by_index.setdefault(o.index, []).extend(o.new_token_ids)
        assert outs[-1].request_done and sum(o.request_done for o in outs) == 1
        return [by_index[i] for i in range(4)], outs

    first, outs = run_n()
    again, _ = run_n()
    assert first == again  # seeded: reproducible run to run
    assert len({tuple(s) for s in first}) == 4  # four different samples
    cached = {o.index: o.num_cached_prompt_tokens for o in outs}
    assert cached[0] == 0 and all(cached[i] == 36 for i in (1, 2, 3))  # siblings reuse the prompt blocks


def test_best_of_returns_the_most_likely(tiny_llama_dir):
    from mindie.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", cacheBlockSize=4, maxSeqLen=256, maxIterTimes=64)
    params = SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    result = llm.generate({"prompt_token_ids": [1, 2, 3, 4, 5]}, params, use_tqdm=False)[0]
    everything = llm.generate({"prompt_token_ids": [1, 2, 3, 4, 5]},
                              SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
                              use_tqdm=False)[0]
    ranked = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in result.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in result.outputs] == [0, 1]
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_random_load_with_aborts_never_leaks(tiny_llama):
    """Random requests (sampling, penalties, stops, n, priorities) on a pool small enough to
    preempt, with random aborts: the block invariant holds after every step and every block
    comes back."""
    import random

    rng = random.Random(11)
    engine = make_engine(tiny_llama, cacheBlockSize=4, numKvBlocks=40, maxPrefillTokens=16, maxBatchSize=6)
    live: set[str] = set()
    finished: set[str] = set()
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            rid = f"r{step}"
            params = SamplingParams(
                max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]),
                top_p=rng.choice([1.0, 0.8]), repetition_penalty=rng.choice([1.0, 1.3]), seed=rng.randint(0, 99),
                stop=rng.choice([(), ("a",)]), n=rng.choice([1, 1, 2]), ignore_eos=rng.random() < 0.5)
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            engine.add_request(EngineRequest(rid, prompt, params, priority=rng.randint(1, 5)))
            live.add(rid)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.request_done:
                live.discard(out.request_id)
                finished.add(out.request_id)
        engine.blocks.check_invariants()
    while engine.has_unfinished():
        engine.step()
        engine.blocks.check_invariants()
    assert len(finished) > 20
    assert engine.blocks.num_used_blocks() == 0 and not engine.requests


def test_queue_wait_is_each_tokens_own(tiny_llama):
    """maxBatchSize 1: the second request waits for the whole first one before its first token,
    then hardly at all; its waits are per token, not its first wait repeated."""
    engine = make_engine(tiny_llama, cacheBlockSize=4, maxBatchSize=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = run(engine, [EngineRequest("a", [1, 2, 3], params), EngineRequest("b", [4, 5, 6], params)])
    waits = [w for o in outs["b"] for w in o.queue_waits_s]
    assert len(waits) == 4 and [b for o in outs["b"] for b in o.batch_sizes] == [1] * 4
    first_done = outs["a"][-1]
    assert waits[0] > max(waits[1:])  # four steps of "a" against a loop iteration
    assert all(len(o.queue_waits_s) == len(o.batch_sizes) == len(o.new_token_ids) for o in outs["a"] + outs["b"])
    assert first_done.finish_reason is FinishReason.LENGTH


def test_seeds_are_uint64(tiny_llama, monkeypatch):
    """Every seed in [0, 2^64-1] is accepted and reproducible, the top half included; an
    unseeded request reports the 64-bit seed it drew."""
    engine = make_engine(tiny_llama, cacheBlockSize=4)
    p = prompts(1)[0]
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1):
        params = SamplingParams(max_tokens=6, seed=seed, ignore_eos=True, n=2)
        first, again = (run(engine, [EngineRequest("s", p, params)])["s"] for _ in range(2))
        assert [(o.index, o.new_token_ids) for o in first] == [(o.index, o.new_token_ids) for o in again]
        assert {o.seed for o in first if o.index == 1} == {(seed + 1) % 2**64}  # sample k: seed + k, wrapped
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\^64-1\]"):
            SamplingParams(seed=bad)
    import mindie.engine.engine as engine_module

    monkeypatch.setattr(engine_module.secrets, "randbits", lambda bits: 2**bits - 1)  # the top of the draw's range
    assert run(engine, [EngineRequest("r", p, SamplingParams(max_tokens=1))])["r"][0].seed == 2**64 - 1
