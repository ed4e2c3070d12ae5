"""Beam search through the engine: the same sequences and scores as transformers' generate() on the
tiny models, under batching, chunked prefill and preemption, with every block returned."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import prompts, run

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, FinishReason, RequestOutput, SamplingParams

MAX_NEW = 14


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def models(request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.getfixturevalue(f"tiny_{request.param}"), hf


def make_engine(loaded, **keys) -> LLMEngine:
    # A small pool: the block invariant is checked after every step and costs a walk over it.
    return LLMEngine(loaded, EngineConfig.from_mindie({"maxSeqLen": 256, "maxIterTimes": 64, "cacheBlockSize": 4,
                                                        "numKvBlocks": 512, **keys}))


def beam(width: int, n: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
         stop_token_ids: tuple[int, ...] = (), max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(use_beam_search=True, n=n, best_of=width, length_penalty=length_penalty,
                          early_stopping=early_stopping, stop_token_ids=stop_token_ids, max_tokens=max_tokens)


def hf_beam_search(hf, prompt: list[int], params: SamplingParams, eos: list[int]
                   ) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search: the returned sequences, each cut after its first EOS (the rest
    is padding), and their scores."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=params.num_samples, num_return_sequences=params.n,
                          length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                          max_new_tokens=params.max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                          return_dict_in_generate=True, output_scores=True)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        seqs.append(row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    return seqs, out.sequences_scores.tolist()


def frequent_tokens(hf, prompt: list[int]) -> tuple[int, ...]:
    """Two tokens greedy decoding produces early: as extra EOS ids they make hypotheses finish."""
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    return tuple(sorted({greedy[2], greedy[5]}))


def check_matches_hf(engine: LLMEngine, hf, prompt: list[int], params: SamplingParams,
                     outs: list[RequestOutput]) -> None:
    eos = sorted(engine.eos_token_ids | set(params.stop_token_ids))
    want, want_scores = hf_beam_search(hf, prompt, params, eos)
    assert [o.index for o in outs] == list(range(params.n))
    assert [o.request_done for o in outs] == [False] * (params.n - 1) + [True]
    assert [o.new_token_ids for o in outs] == want
    for o, score in zip(outs, want_scores):
        assert o.beam_score == pytest.approx(score, rel=1e-4, abs=1e-4)
        assert o.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in o.new_logprobs), abs=1e-3)
        assert o.beam_score == pytest.approx(o.cumulative_logprob / len(o.new_token_ids) ** params.length_penalty,
                                             rel=1e-5)
        assert o.finish_reason is (FinishReason.EOS if o.new_token_ids[-1] in eos else FinishReason.LENGTH)
        assert o.new_text == engine.tokenizer.decode(o.new_token_ids)
        assert o.num_output_tokens == len(o.new_token_ids) and o.num_prompt_tokens == len(prompt)


SEARCHES = [  # (width, n, length_penalty, early_stopping)
    (2, 1, 1.0, False),
    (3, 2, 0.5, True),
    (4, 3, 2.0, "never"),
    (4, 4, -1.0, False),
    (5, 2, 0.0, "never"),
    (6, 3, 1.0, True),
]


@pytest.mark.parametrize("width,n,length_penalty,early_stopping", SEARCHES)
def test_matches_transformers(models, width, n, length_penalty, early_stopping):
    """All prompts in one engine (several beam groups per step); each equals its own HF run."""
    tiny, hf = models
    engine = make_engine(tiny)
    ps = prompts(3, seed=width, max_len=23)
    params = [beam(width, n, length_penalty, early_stopping, stop_token_ids=frequent_tokens(hf, p) if i else ())
              for i, p in enumerate(ps)]
    outs = run(engine, [EngineRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(ps, params))])
    for i, (p, sp) in enumerate(zip(ps, params)):
        check_matches_hf(engine, hf, p, sp, outs[str(i)])


def test_hypotheses_finish_by_eos_and_by_length(models):
    """The EOS path is exercised: some returned hypotheses end in an EOS id, shorter than the limit."""
    tiny, hf = models
    engine = make_engine(tiny)
    reasons = set()
    for i, p in enumerate(prompts(4, seed=21, max_len=23)):
        sp = beam(4, 4, 1.0, "never", stop_token_ids=frequent_tokens(hf, p))
        outs = run(engine, [EngineRequest(str(i), p, sp)])[str(i)]
        check_matches_hf(engine, hf, p, sp, outs)
        reasons |= {o.finish_reason for o in outs}
    assert reasons == {FinishReason.EOS, FinishReason.LENGTH}


@pytest.mark.parametrize("config", [
    dict(maxPrefillTokens=3),  # chunked prompts; a group of 4 decodes over two steps
    dict(cacheBlockSize=1),
    dict(cacheBlockSize=8, enablePrefixCache=False),
])
def test_scheduling_does_not_change_the_result(tiny_llama, config):
    ps = prompts(3, seed=8, max_len=23)
    params = beam(4, 2, 0.7, False, stop_token_ids=(40, 101))
    reference = run(make_engine(tiny_llama), [EngineRequest(str(i), p, params) for i, p in enumerate(ps)])
    outs = run(make_engine(tiny_llama, **config), [EngineRequest(str(i), p, params) for i, p in enumerate(ps)])
    assert {k: [o.new_token_ids for o in v] for k, v in outs.items()} == \
        {k: [o.new_token_ids for o in v] for k, v in reference.items()}


def test_mixed_with_plain_requests_and_preempted(tiny_llama):
    """A pool too small for everything at once: beam groups are preempted whole and recomputed, and
    every request (beam or greedy) gives what it gives alone."""
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reqs = [(f"b{i}", p, beam(3, 2, 1.0, False, max_tokens=18)) for i, p in enumerate(prompts(3, seed=4, max_len=23))]
    reqs += [(f"g{i}", p, greedy) for i, p in enumerate(prompts(4, seed=5, max_len=23))]

    def result(outs: list[RequestOutput]) -> list[list[int]]:
        """Per beam request: each hypothesis' tokens; per greedy request: [all its tokens]."""
        if outs[0].beam_score is not None:
            return [o.new_token_ids for o in outs]
        return [[t for o in outs for t in o.new_token_ids]]

    alone = {rid: result(run(make_engine(tiny_llama), [EngineRequest(rid, p, sp)])[rid]) for rid, p, sp in reqs}
    engine = make_engine(tiny_llama, numKvBlocks=30)
    preempted: list[str] = []
    original = engine.scheduler.preempt

    def spy(seq):
        preempted.append(seq.request.request_id)
        original(seq)

    engine.scheduler.preempt = spy
    mixed = run(engine, [EngineRequest(rid, p, sp) for rid, p, sp in reqs])
    assert any(rid.startswith("b") for rid in preempted), "the pool was meant to preempt a beam group"
    assert {rid: result(outs) for rid, outs in mixed.items()} == alone


def test_abort_in_every_phase_frees_all_blocks(tiny_llama):
    engine = make_engine(tiny_llama, maxPrefillTokens=5)
    long_prompt = list(range(30))
    engine.add_request(EngineRequest("prefilling", long_prompt, beam(4, 2)))
    engine.add_request(EngineRequest("queued", long_prompt, beam(4, 2)))
    engine.step()
    engine.blocks.check_invariants()
    outs = engine.abort("queued") + engine.abort("prefilling")
    assert [(o.request_id, o.index, o.finish_reason, o.new_token_ids, o.request_done) for o in outs] == [
        ("queued", 0, FinishReason.ABORT, [], False), ("queued", 1, FinishReason.ABORT, [], True),
        ("prefilling", 0, FinishReason.ABORT, [], False), ("prefilling", 1, FinishReason.ABORT, [], True)]
    assert engine.blocks.num_used_blocks() == 0
    engine.add_request(EngineRequest("decoding", [1, 2, 3, 4, 5, 6], beam(5, 3, max_tokens=30)))
    for _ in range(6):
        assert engine.step() == []  # a beam request says nothing until it ends
        engine.blocks.check_invariants()
    assert len(engine.requests["decoding"]) == 5  # five live beams, sharing blocks
    assert engine.blocks.num_used_blocks() < 5 * engine.blocks.num_blocks_needed(12)
    assert [o.finish_reason for o in engine.abort("decoding")] == [FinishReason.ABORT] * 3
    assert engine.abort("decoding") == []
    assert not engine.has_unfinished() and engine.blocks.num_used_blocks() == 0
    engine.blocks.check_invariants()


def test_outputs_carry_logprobs_and_timing(tiny_llama):
    engine = make_engine(tiny_llama)
    sp = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=6, logprobs=3, temperature=0.3, top_k=5)
    outs = run(engine, [EngineRequest("r", [5, 6, 7], sp)])["r"]
    plain = run(engine, [EngineRequest("r", [5, 6, 7], beam(3, 2, max_tokens=6))])["r"]
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in plain]  # sampling knobs are ignored
    for o in outs:
        assert len(o.new_logprobs) == len(o.new_token_ids) == 6
        for lp, token in zip(o.new_logprobs, o.new_token_ids):
            assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][1] >= lp.logprob
        # the prompt runs alone, then the three beams together
        assert o.batch_sizes == [1] + [3] * 5 and len(o.queue_waits_s) == 6 and o.first_token_latency_s > 0


def test_llm_generate_returns_the_n_beams(tiny_llama_dir):
    from mindie.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", cacheBlockSize=4, maxSeqLen=256, maxIterTimes=64)
    params = beam(4, 3, 1.0, False, max_tokens=10)
    result = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, params, use_tqdm=False)[0]
    engine = make_engine(llm.engine.loaded)
    want = run(engine, [EngineRequest("r", [9, 8, 7, 6], params)])["r"]
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert [c.token_ids for c in result.outputs] == [o.new_token_ids for o in want]
    assert [c.text for c in result.outputs] == [o.new_text for o in want]
    assert [c.finish_reason for c in result.outputs] == ["length"] * 3


def test_bad_parameters_are_refused(tiny_llama):
    for kwargs, field in [
        (dict(early_stopping="sometimes"), "early_stopping"),
        (dict(early_stopping=1), "early_stopping"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(use_beam_search=1), "use_beam_search"),
        (dict(use_beam_search=True, repetition_penalty=1.2), "repetition_penalty"),
        (dict(use_beam_search=True, presence_penalty=0.5), "presence_penalty"),
        (dict(use_beam_search=True, frequency_penalty=0.5), "frequency_penalty"),
        (dict(use_beam_search=True, stop=("x",)), "stop"),
        (dict(use_beam_search=True, n=3, best_of=2), "best_of"),
        (dict(use_beam_search=True, n=129), "n"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    engine = make_engine(tiny_llama, maxBatchSize=4)
    with pytest.raises(ValueError, match="maxBatchSize"):
        engine.add_request(EngineRequest("wide", [1, 2], beam(5, 1)))
    small = make_engine(tiny_llama, numKvBlocks=8)  # 32 tokens: 8 per beam for a width of 4
    with pytest.raises(ValueError, match="KV cache"):
        small.add_request(EngineRequest("big", list(range(8)), beam(4, 1)))
    assert not engine.has_unfinished() and not small.has_unfinished()


def test_random_load_with_beams_and_aborts_never_leaks(tiny_llama):
    """Beam and sampled requests on a pool small enough to preempt, with random aborts and
    budgets that split groups: the block invariant holds after every step, every beam request
    ends with n outputs, and every block comes back."""
    rng = random.Random(5)
    engine = make_engine(tiny_llama, numKvBlocks=18, maxPrefillTokens=8, maxBatchSize=12)
    live: set[str] = set()
    outputs: dict[str, list[RequestOutput]] = {}
    for step in range(300):
        if rng.random() < 0.5 and len(live) < 10:
            rid = f"r{step}"
            if rng.random() < 0.5:
                width = rng.randint(1, 4)
                params = beam(width, rng.randint(1, width), rng.choice([0.5, 1.0, 2.0]),
                              rng.choice([True, False, "never"]), max_tokens=rng.randint(1, 12),
                              stop_token_ids=rng.choice([(), (40, 101)]))
            else:
                params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]),
                                        seed=rng.randint(0, 99), n=rng.choice([1, 2]))
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 14))]
            engine.add_request(EngineRequest(rid, prompt, params, priority=rng.randint(1, 5)))
            live.add(rid)
            outputs[rid] = []
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            outputs[victim] += engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.request_done:
                live.discard(out.request_id)
        engine.blocks.check_invariants()
        assert len(engine.scheduler.running) <= 12  # maxBatchSize, beams counted one by one
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.blocks.check_invariants()
    assert engine.blocks.num_used_blocks() == 0 and not engine.requests and not engine.beams.pending_logits
    beams = [outs for outs in outputs.values() if outs and outs[-1].beam_score is not None]
    assert len(beams) > 5
    for outs in outputs.values():
        assert outs and outs[-1].request_done and sum(o.request_done for o in outs) == 1
