from __future__ import annotations

import pytest
import torch
from reference.token_mask import apply_token_bitmask as ref_apply
from reference.token_mask import unpack_bitmask

from mindie import ops


def random_bitmask(gen: torch.Generator, num_masks: int, words: int, density: float) -> torch.Tensor:
    """int32 [num_masks, words] with each bit set with probability `density`."""
    bits = (torch.rand(num_masks, words, 32, generator=gen) < density).to(torch.int64)
    packed = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the sign bit is token 31


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000, 49153])
@pytest.mark.parametrize("extra_words", [0, 2])  # a mask wider than the vocabulary
@pytest.mark.parametrize("density", [0.01, 0.5, 0.97])
def test_matches_reference(isa, vocab, extra_words, density):
    gen = torch.Generator().manual_seed(vocab * 7 + extra_words)
    rows, num_masks = 9, 4
    words = (vocab + 31) // 32 + extra_words
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = random_bitmask(gen, num_masks, words, density)
    mask_index = torch.randint(-1, num_masks, (rows,), generator=gen, dtype=torch.int32)
    mask_index[0], mask_index[1] = -1, 2  # at least one free and one shared-mask row
    expected = ref_apply(logits, bitmask, mask_index)
    ops.apply_token_bitmask(logits, bitmask, mask_index)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("vocab", [40, 1000, 4099])
def test_logits_wider_than_mask_are_forbidden(isa, vocab):
    words = 1  # covers tokens 0..31 only
    logits = torch.randn(3, vocab)
    before = logits.clone()
    bitmask = torch.full((1, words), -1, dtype=torch.int32)  # all 32 allowed
    ops.apply_token_bitmask(logits, bitmask, torch.tensor([0, -1, 0], dtype=torch.int32))
    for r in (0, 2):
        assert torch.equal(logits[r, :32], before[r, :32])
        assert torch.isneginf(logits[r, 32:]).all()
    assert torch.equal(logits[1], before[1])


@pytest.mark.parametrize("vocab", [1, 17, 49152, 49155])
def test_all_masked_row_is_all_neg_inf(isa, vocab):
    logits = torch.randn(2, vocab)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    ops.apply_token_bitmask(logits, bitmask, torch.tensor([0, 0], dtype=torch.int32))
    assert torch.isneginf(logits).all()


def test_default_index_and_strided_rows(isa):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(4, 300, generator=gen)
    logits = base[:, :257]  # row stride 300, the last 43 columns must stay untouched
    bitmask = random_bitmask(gen, 4, 9, 0.3)
    expected = ref_apply(logits, bitmask, torch.arange(4, dtype=torch.int32))
    tail = base[:, 257:].clone()
    ops.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.equal(base[:, 257:], tail)


@pytest.mark.parametrize("vocab,words", [(1000, 32), (1000, 40), (1300, 40)])
def test_matches_llguidance_own_masking(isa, vocab, words):
    llg_numpy = pytest.importorskip("llguidance.numpy")  # the library that fills the masks
    gen = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = random_bitmask(gen, 5, words, 0.3)
    expected = logits.numpy().copy()
    llg_numpy.apply_token_bitmask_inplace(expected, bitmask.numpy())
    ops.apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, torch.from_numpy(expected))


def test_reference_unpacks_llguidance_layout():
    # word 0 = 0b101 allows tokens 0 and 2; word 1 has only its sign bit: token 63
    bitmask = torch.tensor([[5, -(2**31)]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_empty_batch_is_a_no_op():
    ops.apply_token_bitmask(torch.empty(0, 10), torch.zeros(1, 1, dtype=torch.int32))


def test_bad_arguments_raise():
    logits = torch.randn(2, 64)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="logits.*float32"):
        ops.apply_token_bitmask(logits.bfloat16(), bitmask, idx)
    with pytest.raises(TypeError, match="bitmask.*int32"):
        ops.apply_token_bitmask(logits, bitmask.long(), idx)
    with pytest.raises(TypeError, match="mask_index.*int32"):
        ops.apply_token_bitmask(logits, bitmask, idx.long())
    with pytest.raises(ValueError, match=r"mask_index\[1\] = 3 is out of range"):
        ops.apply_token_bitmask(logits, bitmask, torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"mask_index\[0\] = -2"):
        ops.apply_token_bitmask(logits, bitmask, torch.tensor([-2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="mask_index.*rows of logits"):
        ops.apply_token_bitmask(logits, bitmask, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask.*at least one"):
        ops.apply_token_bitmask(logits, torch.zeros(3, 0, dtype=torch.int32), idx)
    with pytest.raises(ValueError, match="logits.*dimensions"):
        ops.apply_token_bitmask(logits[0], bitmask, idx)
    with pytest.raises(ValueError, match="logits.*contiguous"):
        ops.apply_token_bitmask(logits.t(), bitmask, idx)
