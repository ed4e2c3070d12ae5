from __future__ import annotations

import math

import pytest
import torch
from reference.sampling import apply_penalties, filtered_distribution, philox4x32_10
from reference.sampling import sample as ref_sample

from mindie import ops


def make_batch(
    gen: torch.Generator,
    rows: int,
    vocab: int,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    penalties: bool = True,
    scale: float = 3.0,
) -> dict[str, torch.Tensor]:
    """Random logits and per-row parameters; a fixed value replaces a random column."""
    logits = torch.randn(rows, vocab, generator=gen) * scale
    temp = torch.rand(rows, generator=gen) * 1.5 + 0.1
    temp[torch.rand(rows, generator=gen) < 0.15] = 0.0
    k_choices = torch.tensor([-1, 0, 1, 3, 50, 700, 1500, vocab, vocab + 5], dtype=torch.int32)
    k = k_choices[torch.randint(0, len(k_choices), (rows,), generator=gen)]
    p_choices = torch.tensor([1.0, 1.0, 0.95, 0.8, 0.3, 0.01])
    p = p_choices[torch.randint(0, len(p_choices), (rows,), generator=gen)]
    batch = dict(
        logits=logits,
        temperature=torch.full((rows,), temperature) if temperature is not None else temp,
        top_k=torch.full((rows,), top_k, dtype=torch.int32) if top_k is not None else k,
        top_p=torch.full((rows,), top_p) if top_p is not None else p,
        seed=torch.randint(-(2**62), 2**62, (rows,), generator=gen),
        step=torch.randint(0, 5000, (rows,), generator=gen),
    )
    if penalties:
        plen = torch.randint(0, 40, (rows,), generator=gen)
        olen = torch.randint(0, 30, (rows,), generator=gen)
        # Tokens drawn from the high logits so that the penalties change the outcome.
        top = torch.topk(logits, min(vocab, 12), dim=1).indices
        prompt = [
            top[b, torch.randint(0, top.shape[1], (int(plen[b]),), generator=gen)]
            for b in range(rows)
        ]
        output = [
            top[b, torch.randint(0, top.shape[1], (int(olen[b]),), generator=gen)]
            for b in range(rows)
        ]
        batch.update(
            repetition_penalty=torch.rand(rows, generator=gen) * 1.5 + 0.5,
            presence_penalty=torch.rand(rows, generator=gen) * 4 - 2,
            frequency_penalty=torch.rand(rows, generator=gen) * 4 - 2,
            prompt_tokens=torch.cat(prompt).to(torch.int64),
            prompt_offsets=torch.cat([torch.zeros(1), torch.cumsum(plen, 0)]).to(torch.int64),
            output_tokens=torch.cat(output).to(torch.int64),
            output_offsets=torch.cat([torch.zeros(1), torch.cumsum(olen, 0)]).to(torch.int64),
        )
    return batch


def take_rows(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """The same requests as a new batch made of `rows` (in that order), CSR lists included."""
    out = {
        k: v[rows].contiguous() for k, v in batch.items() if v.shape[0] == batch["logits"].shape[0]
    }
    for name in ("prompt", "output"):
        if f"{name}_tokens" not in batch:
            continue
        tokens, offsets = batch[f"{name}_tokens"], batch[f"{name}_offsets"]
        parts = [tokens[offsets[r] : offsets[r + 1]] for r in rows]
        out[f"{name}_tokens"] = torch.cat(parts)
        out[f"{name}_offsets"] = torch.cat(
            [torch.zeros(1), torch.cumsum(torch.tensor([len(p) for p in parts]), 0)]
        ).to(torch.int64)
    return out


def run(batch: dict[str, torch.Tensor], num_logprobs: int = 0) -> ops.SampleOutput:
    return ops.sample(**batch, num_logprobs=num_logprobs)


def test_philox_reference_known_answers():
    # Random123 kat_vectors for philox4x32_10.
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    )
    assert philox4x32_10(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    ) == (
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    )


@pytest.mark.parametrize("vocab", [1, 7, 300, 3000, 49152])
@pytest.mark.parametrize("penalties", [False, True])
def test_matches_reference(isa, vocab, penalties):
    """Same tokens as the reference (same Philox draw, same candidate order), mixed per-row
    parameters covering the heap (k <= 1024) and histogram paths, logprobs of the raw logits."""
    gen = torch.Generator().manual_seed(vocab + penalties)
    batch = make_batch(gen, 24, vocab, penalties=penalties)
    n = min(vocab, 20)
    out = run(batch, n)
    tokens, logprobs, top_lp, top_ids = ref_sample(**batch, num_logprobs=n)
    assert torch.equal(out.token_ids, tokens)
    torch.testing.assert_close(out.logprobs, logprobs, atol=2e-5, rtol=1e-5)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_lp, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "top_k,top_p", [(1, 1.0), (5, 1.0), (40, 1.0), (0, 0.5), (0, 0.9), (30, 0.7), (2000, 0.9)]
)
def test_filtered_tokens_never_drawn(isa, top_k, top_p):
    gen = torch.Generator().manual_seed(top_k)
    vocab, rows = 2500, 400
    row = torch.randn(vocab, generator=gen) * 2
    logits = row.repeat(rows, 1)
    batch = dict(
        logits=logits,
        temperature=torch.full((rows,), 1.3),
        top_k=torch.full((rows,), top_k, dtype=torch.int32),
        top_p=torch.full((rows,), top_p),
        seed=torch.arange(rows, dtype=torch.int64) * 7919,
        step=torch.zeros(rows, dtype=torch.int64),
    )
    allowed = filtered_distribution(row, 1.3, top_k, top_p) > 0
    if top_k > 0:
        assert int(allowed.sum()) <= top_k
    out = run(batch)
    assert bool(allowed[out.token_ids].all())
    assert len(torch.unique(out.token_ids)) > 1 or int(allowed.sum()) == 1


def test_greedy_is_argmax_lowest_index_on_ties(isa):
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(gen, 16, 1000, temperature=0.0, penalties=False)
    batch["logits"][3, [10, 500, 999]] = 100.0  # a three-way tie: the lowest index wins
    batch["logits"][4] = 0.0  # all equal
    out = run(batch)
    expected = torch.argmax(batch["logits"], dim=1)
    assert torch.equal(out.token_ids, expected)
    assert out.token_ids[3] == 10 and out.token_ids[4] == 0


def test_penalties_match_reference_on_greedy(isa):
    """Exact float32 penalties: the greedy choice equals the argmax of the reference's penalised
    logits on rows whose penalised tokens are the top ones (the penalties decide the winner)."""
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, 64, 777, temperature=0.0, penalties=True)
    out = run(batch)
    changed = 0
    for b in range(64):
        po, oo = batch["prompt_offsets"], batch["output_offsets"]
        x = apply_penalties(
            batch["logits"][b],
            batch["prompt_tokens"][po[b] : po[b + 1]],
            batch["output_tokens"][oo[b] : oo[b + 1]],
            batch["repetition_penalty"][b],
            batch["presence_penalty"][b],
            batch["frequency_penalty"][b],
        )
        assert int(out.token_ids[b]) == int(torch.argmax(x)), b
        changed += int(torch.argmax(x)) != int(torch.argmax(batch["logits"][b]))
    assert changed > 10  # the test exercises the penalties


CRAFTED = [
    # (logits, prompt, output, rp, presence, frequency, expected greedy token)
    ([2.0, 1.9], [0], [], 1.1, 0.0, 0.0, 1),  # positive logit divided: 1.818 < 1.9
    ([-1.0, -1.05], [], [0], 1.1, 0.0, 0.0, 1),  # negative logit multiplied: -1.1 < -1.05
    ([2.0, 1.7], [0, 0], [0, 0, 0], 1.1, 0.0, 0.0, 0),  # once per token: 1.818 > 1.7 (twice: 1.65)
    ([1.0, 0.8], [], [0], 1.0, 0.3, 0.0, 1),  # presence: 0.7 < 0.8
    ([1.0, 0.5], [], [0, 0, 0], 1.0, 0.0, 0.2, 1),  # frequency x3: 0.4 < 0.5
    ([1.0, 0.5], [], [0, 0], 1.0, 0.0, 0.2, 0),  # frequency x2: 0.6 > 0.5
    ([1.0, 0.8], [0], [], 1.0, 0.5, 0.5, 0),  # presence/frequency ignore the prompt
    ([0.5, 1.0], [], [0], 1.0, -0.6, 0.0, 0),  # negative presence boosts: 1.1 > 1.0
    ([3.0, 1.0, 2.9], [0], [2, 2], 2.0, 0.0, -0.1, 2),  # 3 -> 1.5; 2.9 -> 1.45 + 0.2 = 1.65
    ([0.0, -0.1], [0], [], 3.0, 0.0, 0.0, 0),  # zero stays zero
]


@pytest.mark.parametrize("logits,prompt,output,rp,presence,frequency,expected", CRAFTED)
def test_penalties_crafted(isa, logits, prompt, output, rp, presence, frequency, expected):
    t = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt)  # noqa: E731
    batch = dict(
        logits=t([logits]),
        temperature=t([0.0]),
        top_k=t([0], torch.int32),
        top_p=t([1.0]),
        seed=t([0], torch.int64),
        step=t([0], torch.int64),
        repetition_penalty=t([rp]),
        presence_penalty=t([presence]),
        frequency_penalty=t([frequency]),
        prompt_tokens=t(prompt, torch.int64),
        prompt_offsets=t([0, len(prompt)], torch.int64),
        output_tokens=t(output, torch.int64),
        output_offsets=t([0, len(output)], torch.int64),
    )
    assert int(run(batch).token_ids[0]) == expected
    assert int(ref_sample(**batch)[0][0]) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_logprobs", [0, 1, 20])
def test_logprobs_and_top_n_are_raw_log_softmax(isa, dtype, num_logprobs):
    gen = torch.Generator().manual_seed(num_logprobs)
    batch = make_batch(gen, 12, 4096, penalties=True)
    batch["logits"] = batch["logits"].to(dtype)
    out = run(batch, num_logprobs)
    raw = torch.log_softmax(batch["logits"].float(), dim=-1)
    torch.testing.assert_close(
        out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0], atol=2e-5, rtol=1e-5
    )
    assert out.top_logprobs.shape == (12, num_logprobs) and out.top_ids.shape == (12, num_logprobs)
    if num_logprobs:
        top = torch.topk(raw, num_logprobs, dim=1)
        torch.testing.assert_close(out.top_logprobs, top.values, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(
            out.top_logprobs, raw.gather(1, out.top_ids), atol=2e-5, rtol=1e-5
        )
        assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    if dtype == torch.bfloat16:  # bfloat16 logits sample like their float32 values
        batch["logits"] = batch["logits"].float()
        assert torch.equal(run(batch, num_logprobs).token_ids, out.token_ids)


DIST_CASES = [
    # vocab, temperature, top_k, top_p  (vocab > 1024 with k off: the histogram path)
    (40, 1.0, 0, 1.0),
    (40, 0.7, 8, 1.0),
    (40, 1.3, 0, 0.8),
    (40, 0.9, 12, 0.6),
    (1100, 1.0, 0, 0.9),
    (1100, 0.8, 1050, 0.95),
]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p", DIST_CASES)
def test_draws_follow_reference_distribution(vocab, temperature, top_k, top_p):
    """Many seeds over one row: the empirical distribution is within a fixed total-variation bound
    of the reference probabilities (3x the TV expected from sampling noise), filtered tokens never
    appear. Fixed seeds: deterministic."""
    gen = torch.Generator().manual_seed(vocab + top_k)
    row = torch.randn(vocab, generator=gen) * (1.0 if vocab < 100 else 2.5)
    rows, calls = 2000, 20
    logits = row.repeat(rows, 1)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for call in range(calls):
        batch = dict(
            logits=logits,
            temperature=torch.full((rows,), temperature),
            top_k=torch.full((rows,), top_k, dtype=torch.int32),
            top_p=torch.full((rows,), top_p),
            seed=torch.arange(rows, dtype=torch.int64) + 1000 * call,
            step=torch.full((rows,), call, dtype=torch.int64),
        )
        counts += torch.bincount(run(batch).token_ids, minlength=vocab).to(torch.float64)
    n = rows * calls
    probs = filtered_distribution(row, temperature, top_k, top_p)
    assert counts[probs == 0].sum() == 0
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    expected_tv = 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs.tolist())
    assert tv < 3 * expected_tv, (tv, expected_tv)


def test_seeded_draw_independent_of_batch_and_row_order(isa):
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(gen, 32, 3000, penalties=True)
    batch["temperature"].clamp_(min=0.5)  # every row samples
    full = run(batch).token_ids
    for r in (0, 7, 31):
        assert int(run(take_rows(batch, [r])).token_ids[0]) == int(full[r])
    perm = torch.randperm(32, generator=gen).tolist()
    assert torch.equal(run(take_rows(batch, perm)).token_ids, full[perm])
    # The same request inside a different batch: its neighbours do not matter.
    other = make_batch(torch.Generator().manual_seed(6), 32, 3000, penalties=True)
    mixed = take_rows(other, list(range(32)))
    for key in ("logits", "temperature", "top_k", "top_p", "seed", "step"):
        mixed[key][17] = batch[key][7]
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        mixed[key][17] = batch[key][7]
    mixed_rows = take_rows(mixed, list(range(32)))
    for name in ("prompt", "output"):  # row 17 of `mixed` gets row 7's token lists
        tok, off = batch[f"{name}_tokens"], batch[f"{name}_offsets"]
        otok, ooff = mixed[f"{name}_tokens"], mixed[f"{name}_offsets"]
        parts = [otok[ooff[r] : ooff[r + 1]] for r in range(32)]
        parts[17] = tok[off[7] : off[8]]
        mixed_rows[f"{name}_tokens"] = torch.cat(parts)
        mixed_rows[f"{name}_offsets"] = torch.cat(
            [torch.zeros(1), torch.cumsum(torch.tensor([len(p) for p in parts]), 0)]
        ).to(torch.int64)
    assert int(run(mixed_rows).token_ids[17]) == int(full[7])


def test_steps_and_seeds_change_the_draw(isa):
    vocab, rows = 1000, 64
    batch = dict(
        logits=torch.zeros(rows, vocab),  # uniform: every draw is a fresh uniform
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        seed=torch.full((rows,), 1234, dtype=torch.int64),
        step=torch.arange(rows, dtype=torch.int64),
    )
    by_step = run(batch).token_ids
    assert len(torch.unique(by_step)) > 55  # 64 draws from 1000 tokens
    assert torch.equal(run(batch).token_ids, by_step)  # and reproducible
    batch["step"] = torch.full((rows,), 9, dtype=torch.int64)
    same = run(batch).token_ids
    assert len(torch.unique(same)) == 1 and int(same[0]) == int(by_step[9])
    batch["seed"] = torch.arange(rows, dtype=torch.int64)
    assert len(torch.unique(run(batch).token_ids)) > 55


def test_masked_and_nan_logits(isa):
    vocab = 2000
    logits = torch.randn(4, vocab)
    logits[:, ::2] = float("-inf")  # half the vocabulary masked
    logits[1, 5] = float("nan")  # read as -inf
    logits[2] = float("-inf")  # nothing possible: the argmax convention, token 0
    logits[3, 7] = float("inf")  # read as the largest float: always chosen
    batch = dict(
        logits=logits,
        temperature=torch.tensor([1.0, 1.0, 1.0, 0.5]),
        top_k=torch.tensor([0, 1500, 0, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 1.0, 1.0]),
        seed=torch.arange(4, dtype=torch.int64),
        step=torch.zeros(4, dtype=torch.int64),
    )
    for _ in range(10):
        out = run(batch, 3)
        assert out.token_ids[0] % 2 == 1 and out.token_ids[1] % 2 == 1 and out.token_ids[1] != 5
        assert int(out.token_ids[2]) == 0 and int(out.token_ids[3]) == 7
        batch["seed"] += 100


def base_batch(rows: int = 3, vocab: int = 10) -> dict[str, torch.Tensor]:
    return dict(
        logits=torch.randn(rows, vocab),
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int32),
        top_p=torch.ones(rows),
        seed=torch.zeros(rows, dtype=torch.int64),
        step=torch.zeros(rows, dtype=torch.int64),
        repetition_penalty=torch.ones(rows),
        presence_penalty=torch.zeros(rows),
        frequency_penalty=torch.zeros(rows),
        prompt_tokens=torch.tensor([1, 2, 3]),
        prompt_offsets=torch.tensor([0, 1, 2, 3]),
        output_tokens=torch.tensor([4, 5]),
        output_offsets=torch.tensor([0, 0, 2, 2]),
    )


BAD = [
    (dict(logits=torch.randn(3, 10).to(torch.float64)), "logits"),
    (dict(logits=torch.randn(3, 10).to(torch.int32)), "logits"),
    (dict(logits=torch.randn(3, 10, 1)), "logits"),
    (dict(logits=torch.randn(3, 20)[:, ::2]), "logits"),
    (dict(temperature=torch.ones(3, dtype=torch.float64)), "temperature"),
    (dict(temperature=torch.ones(4)), "temperature"),
    (dict(temperature=torch.ones(6)[::2]), "temperature"),
    (dict(temperature=torch.tensor([1.0, -0.5, 1.0])), "temperature"),
    (dict(temperature=torch.tensor([1.0, float("nan"), 1.0])), "temperature"),
    (dict(temperature=torch.tensor([1.0, float("inf"), 1.0])), "temperature"),
    (dict(temperature=[1.0, 1.0, 1.0]), "temperature"),
    (dict(top_k=torch.zeros(3, dtype=torch.int64)), "top_k"),
    (dict(top_k=torch.tensor([0, -2, 0], dtype=torch.int32)), "top_k"),
    (dict(top_p=torch.tensor([1.0, 0.0, 1.0])), "top_p"),
    (dict(top_p=torch.tensor([1.0, 1.5, 1.0])), "top_p"),
    (dict(top_p=torch.tensor([1.0, float("nan"), 1.0])), "top_p"),
    (dict(seed=torch.zeros(3, dtype=torch.int32)), "seed"),
    (dict(step=torch.tensor([0, -1, 0])), "step"),
    (dict(repetition_penalty=torch.tensor([1.0, 0.0, 1.0])), "repetition_penalty"),
    (dict(repetition_penalty=torch.tensor([1.0, -1.0, 1.0])), "repetition_penalty"),
    (dict(presence_penalty=torch.tensor([0.0, float("inf"), 0.0])), "presence_penalty"),
    (dict(frequency_penalty=torch.tensor([0.0, float("nan"), 0.0])), "frequency_penalty"),
    (dict(frequency_penalty=torch.zeros(2)), "frequency_penalty"),
    (dict(prompt_tokens=torch.tensor([1, -1, 3])), "prompt_tokens"),
    (dict(prompt_tokens=torch.tensor([1, 10, 3])), "prompt_tokens"),
    (dict(prompt_tokens=torch.tensor([1, 2, 3], dtype=torch.int32)), "prompt_tokens"),
    (dict(output_tokens=torch.tensor([4, 99])), "output_tokens"),
    (dict(prompt_offsets=torch.tensor([0, 1, 3])), "prompt_offsets"),
    (dict(prompt_offsets=torch.tensor([0, 2, 1, 3])), "prompt_offsets"),
    (dict(prompt_offsets=torch.tensor([0, 1, 2, 2])), "prompt_offsets"),
    (dict(prompt_offsets=torch.tensor([1, 1, 2, 3])), "prompt_offsets"),
    (dict(output_offsets=torch.tensor([0, 0, 2, 5])), "output_offsets"),
    (dict(prompt_offsets=None), "prompt_offsets"),
]


@pytest.mark.parametrize("override,name", BAD)
def test_bad_arguments_raise(override, name):
    batch = base_batch()
    batch.update(override)
    with pytest.raises((ValueError, TypeError), match=name):
        ops.sample(**batch)


@pytest.mark.parametrize("n", [-1, 21, 11])
def test_bad_num_logprobs_raises(n):
    with pytest.raises(ValueError, match="num_logprobs"):
        ops.sample(**base_batch(vocab=10), num_logprobs=n)


def test_optional_penalties_and_empty_batch(isa):
    batch = base_batch()
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        del batch[key]
    for key in ("prompt_tokens", "prompt_offsets", "output_tokens", "output_offsets"):
        batch[key] = None
    out = run(batch, 2)
    assert out.token_ids.shape == (3,) and bool(((out.token_ids >= 0) & (out.token_ids < 10)).all())
    empty = {
        k: (v[:0] if v is not None and k != "prompt_offsets" else v)
        for k, v in base_batch().items()
    }
    empty["prompt_tokens"] = empty["output_tokens"] = torch.zeros(0, dtype=torch.int64)
    empty["prompt_offsets"] = empty["output_offsets"] = torch.zeros(1, dtype=torch.int64)
    assert run(empty, 3).token_ids.shape == (0,)
