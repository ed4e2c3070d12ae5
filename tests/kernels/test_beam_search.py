from __future__ import annotations

import pytest
import torch
from reference.beam_search import BeamHypotheses
from reference.beam_search import beam_search_step as ref_step

from mindie import ops


def random_logprobs(
    gen: torch.Generator, rows: int, vocab: int, eos: list[int], boost: float
) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 2
    # Make EOS competitive on some rows so that hypotheses finish at every rank.
    for e in eos:
        logits[:, e] += boost * (torch.rand(rows, generator=gen) < 0.5)
    return torch.log_softmax(logits, dim=-1)


def run_search(
    groups: int,
    width: int,
    vocab: int,
    eos: list[int],
    length_penalty: float,
    early_stopping: bool | str,
    steps: int,
    seed: int,
    boost: float = 4.0,
    max_len: int = 0,
) -> tuple[int, int]:
    """Runs `steps` steps of the kernel and of the HF reference side by side on random log-probs,
    feeding both the kernel's chosen beams, and compares every output and the finished
    hypotheses (score and sequence) after every step. Returns (groups done, hypotheses offered)."""
    gen = torch.Generator().manual_seed(seed)
    state = ops.BeamSearchState.new(groups, width)
    ref_hyps = [
        BeamHypotheses(width, length_penalty, early_stopping, max_len) for _ in range(groups)
    ]
    ref_done = [False] * groups
    # HF starts with only the first beam of each group alive.
    beam_scores = torch.full((groups, width), -1e9)
    beam_scores[:, 0] = 0
    beam_scores = beam_scores.view(-1)
    sequences: list[tuple[int, ...]] = [()] * (groups * width)
    slots: list[list[tuple[int, ...] | None]] = [[None] * width for _ in range(groups)]
    pad = 1 if len(eos) > 1 else -1
    offered = 0
    for step in range(steps):
        cur_len = step + 1
        logprobs = random_logprobs(gen, groups * width, vocab, eos, boost)
        out = ops.beam_search_step(
            logprobs,
            beam_scores,
            state,
            torch.tensor(eos),
            cur_len,
            length_penalty,
            early_stopping,
            max_len,
            pad,
        )
        ref = ref_step(
            logprobs,
            beam_scores,
            ref_hyps,
            ref_done,
            sequences,
            eos,
            cur_len,
            pad if pad >= 0 else eos[0],
        )
        assert torch.equal(out.next_parents, ref.next_parents), step
        assert torch.equal(out.next_tokens, ref.next_tokens), step
        assert torch.equal(out.next_scores, ref.next_scores), step
        assert out.done.tolist() == ref.done, step
        for g in range(groups):
            fin = ref.finished[g]
            offered += len(fin)
            assert int(out.fin_count[g]) == len(fin)
            for j, (parent, token, logprob, score) in enumerate(fin):
                assert int(out.fin_parents[g, j]) == parent and int(out.fin_tokens[g, j]) == token
                assert float(out.fin_logprobs[g, j]) == logprob
                assert float(out.fin_scores[g, j]) == score
                slot = int(out.fin_slots[g, j])
                if slot >= 0:
                    slots[g][slot] = sequences[parent] + (token,)
            assert bool((out.fin_parents[g, len(fin) :] == -1).all())
            # The kept hypotheses: same scores and sequences as HF's list.
            n = int(state.num_hyps[g])
            kept = sorted((float(state.hyp_scores[g, j]), slots[g][j]) for j in range(n))
            assert kept == sorted(ref_hyps[g].beams), (step, g)
            assert float(state.worst_score[g]) == ref_hyps[g].worst_score
        sequences = [
            sequences[p] + (t,)
            for p, t in zip(
                out.next_parents.view(-1).tolist(), out.next_tokens.view(-1).tolist(), strict=True
            )
        ]
        beam_scores = out.next_scores.view(-1).clone()
        if all(ref_done):
            break
    return sum(ref_done), offered


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.6, 2.0, -0.5])
def test_matches_hf_over_a_search(isa, early_stopping, length_penalty):
    offered = 0
    for seed in range(3):
        offered += run_search(
            groups=3,
            width=4,
            vocab=60,
            eos=[0],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            steps=14,
            seed=seed,
            max_len=20,
        )[1]
    assert offered > 0


@pytest.mark.parametrize(
    "early_stopping,length_penalty", [(True, 1.0), (False, 1.0), ("never", -0.5)]
)
def test_groups_finish_and_pad(isa, early_stopping, length_penalty):
    done = sum(
        run_search(
            groups=4,
            width=3,
            vocab=30,
            eos=[0],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            steps=25,
            seed=seed,
            boost=6.0,
            max_len=30,
        )[0]
        for seed in range(2)
    )
    assert done > 0  # groups that are done keep stepping with padding, compared with HF


@pytest.mark.parametrize("eos", [[5], [5, 9], [3, 3, 7]])
@pytest.mark.parametrize("width", [1, 2, 5])
def test_matches_hf_eos_sets_and_widths(isa, eos, width):
    run_search(
        groups=2,
        width=width,
        vocab=40,
        eos=eos,
        length_penalty=1.3,
        early_stopping=False,
        steps=10,
        seed=width * 10 + len(eos),
        boost=5.0,
    )


def test_large_vocab_single_step(isa):
    """G=4, W=4, V=49152 with EOS among the candidates: compared with the reference."""
    gen = torch.Generator().manual_seed(11)
    groups, width, vocab, eos = 4, 4, 49152, [2]
    logprobs = random_logprobs(gen, groups * width, vocab, eos, boost=6.0)
    beam_scores = -torch.rand(groups * width, generator=gen) * 3
    state = ops.BeamSearchState.new(groups, width)
    state.done[2] = 1  # a finished group pads
    state.num_hyps[2] = width
    out = ops.beam_search_step(logprobs, beam_scores, state, [2], cur_len=7, length_penalty=0.8)
    hyps = [BeamHypotheses(width, 0.8, False) for _ in range(groups)]
    hyps[2].beams = [(0.0, ())] * width
    done = [False, False, True, False]
    ref = ref_step(logprobs, beam_scores, hyps, done, [()] * (groups * width), eos, 7, 2)
    assert torch.equal(out.next_parents, ref.next_parents)
    assert torch.equal(out.next_tokens, ref.next_tokens)
    assert torch.equal(out.next_scores, ref.next_scores)
    assert (
        out.next_parents[2].tolist() == [8] * width and out.next_tokens[2].tolist() == [2] * width
    )
    assert out.next_scores[2].tolist() == [0.0] * width
    assert out.fin_count.tolist() == [len(f) for f in ref.finished]
    assert sum(len(f) for f in ref.finished) > 0
    assert out.done.tolist() == ref.done


def test_ties_break_by_lower_flat_index(isa):
    groups, width, vocab = 1, 2, 8
    logprobs = torch.full((2, vocab), -5.0)
    logprobs[0, 6] = logprobs[0, 3] = logprobs[1, 1] = -1.0  # three-way tie
    state = ops.BeamSearchState.new(groups, width)
    out = ops.beam_search_step(logprobs, torch.zeros(2), state, [0], cur_len=1)
    assert out.next_parents.tolist() == [[0, 0]] and out.next_tokens.tolist() == [[3, 6]]


def bad_call(**override):
    groups, width, vocab = 2, 3, 16
    args = dict(
        logprobs=torch.log_softmax(torch.randn(groups * width, vocab), -1),
        beam_scores=torch.zeros(groups * width),
        state=ops.BeamSearchState.new(groups, width),
        eos_token_ids=torch.tensor([1]),
        cur_len=1,
        length_penalty=1.0,
        early_stopping=False,
        max_len=0,
    )
    args.update(override)
    return ops.beam_search_step(**args)


def state_with(**fields) -> ops.BeamSearchState:
    state = ops.BeamSearchState.new(2, 3)
    for k, v in fields.items():
        setattr(state, k, v)
    return state


BAD = [
    (dict(logprobs=torch.randn(6, 16, dtype=torch.float64)), "logprobs"),
    (dict(logprobs=torch.randn(6, 16).to(torch.bfloat16)), "logprobs"),
    (dict(logprobs=torch.randn(7, 16)), "logprobs"),
    (dict(logprobs=torch.randn(6, 32)[:, ::2]), "logprobs"),
    (dict(logprobs=torch.randn(6)), "logprobs"),
    (dict(beam_scores=torch.zeros(5)), "beam_scores"),
    (dict(beam_scores=torch.zeros(6, dtype=torch.float64)), "beam_scores"),
    (dict(beam_scores=torch.tensor([0.0, float("nan"), 0, 0, 0, 0])), "beam_scores"),
    (dict(eos_token_ids=torch.tensor([16])), "eos_token_ids"),
    (dict(eos_token_ids=torch.tensor([-1])), "eos_token_ids"),
    (dict(eos_token_ids=torch.tensor([1], dtype=torch.int32)), "eos_token_ids"),
    (dict(eos_token_ids=list(range(16))), "vocab_size"),
    (dict(cur_len=0), "cur_len"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(early_stopping="never", length_penalty=1.0, max_len=0), "max_len"),
    (dict(state=state_with(num_hyps=torch.tensor([0, 4]))), "num_hyps"),
    (dict(state=state_with(num_hyps=torch.tensor([0, -1]))), "num_hyps"),
    (dict(state=state_with(done=torch.tensor([0, 2], dtype=torch.int32))), "done"),
    (dict(state=state_with(done=torch.zeros(2, dtype=torch.int64))), "done"),
    (dict(state=state_with(hyp_scores=torch.zeros(2, 3))), "hyp_scores"),
    (dict(state=state_with(worst_score=torch.zeros(2))), "worst_score"),
    (dict(state=state_with(hyp_order=torch.zeros(2, 4, dtype=torch.int64))), "hyp_order"),
]


@pytest.mark.parametrize("override,name", BAD)
def test_bad_arguments_raise(override, name):
    with pytest.raises((ValueError, TypeError), match=name):
        bad_call(**override)
