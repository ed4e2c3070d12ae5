"""A GGUF tokenizer's token types read as llama.cpp reads them: NORMAL tokens decode, USER_DEFINED
ones are written as they are, CONTROL (and UNKNOWN) ones only when special tokens are kept, and
UNUSED ones (the converter's `[PAD<id>]` padding up to the model's vocabulary, as in every real
Qwen GGUF) and UNDEFINED ones never, nor are they ever read from text. The tiny Qwen3 GGUF then
decodes every id as its Hugging Face tokenizer does (which has no token at the padded ids), and a
served model that samples a padded id writes nothing for it."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest
import torch

from mindie.config import EngineConfig
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, SamplingParams
from mindie.model.gguf_header import read_header
from mindie.model.loader import load_model
from mindie.structured.grammar import GrammarCompiler
from mindie.tokenizer import Tokenizer


def gguf_tokenizer(path: Path) -> Tokenizer:
    fields = read_header(str(path)).fields
    return Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k.startswith("tokenizer.")})


@pytest.fixture(scope="module")
def tokenizers(tiny_qwen3_dir, tiny_qwen3_gguf) -> tuple[Tokenizer, Tokenizer, list[int]]:
    """(from the GGUF, from the Hugging Face directory, the GGUF's token types)."""
    types = list(read_header(str(tiny_qwen3_gguf)).fields["tokenizer.ggml.token_type"])
    return gguf_tokenizer(tiny_qwen3_gguf), Tokenizer.from_hf_dir(str(tiny_qwen3_dir)), types


def test_the_tiny_qwen3_gguf_is_padded_as_the_converter_pads(tokenizers):
    ours, hf, types = tokenizers
    kinds = gguf.TokenType
    assert len(types) == 320 and hf.vocab_size == 261
    assert types[261:] == [kinds.UNUSED] * 59 and types.count(kinds.CONTROL) == 3
    assert [types[hf.backend.token_to_id(t)] for t in ("<think>", "</think>")] == [kinds.USER_DEFINED] * 2
    assert ours.vocab_size == 320  # the ids the GGUF spans, as llama.cpp's n_vocab
    assert all(ours.id_to_token(i) is None for i in range(261, 320))


@pytest.mark.parametrize("skip_special", [True, False])
def test_every_id_decodes_as_the_hugging_face_tokenizer_does(tokenizers, skip_special):
    ours, hf, _ = tokenizers
    rng = random.Random(7)
    pad, control, think = 300, hf.backend.token_to_id("<|im_start|>"), hf.backend.token_to_id("<think>")
    mixed = [*hf.encode("ab"), pad, control, think, *hf.encode("c"), 319]
    cases = [mixed, [pad], [control], list(range(320))] + [[rng.randrange(320) for _ in range(24)] for _ in range(50)]
    for ids in cases:
        assert ours.decode(ids, skip_special) == hf.decode(ids, skip_special), ids
    assert ours.decode(mixed, skip_special) == ("ab" + ("" if skip_special else "<|im_start|>") + "<think>c")


def test_padding_text_is_never_read_as_its_token(tokenizers):
    ours, hf, _ = tokenizers
    for text in ("[PAD300]", "x[PAD261]y"):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False) and max(ids) < 261
        assert ours.decode(ids) == text


def test_a_grammar_never_allows_a_padded_id(tokenizers):
    ours, _, _ = tokenizers
    compiler = GrammarCompiler(ours, num_threads=1)
    assert compiler.vocab_size == 320
    matcher = compiler.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}).matcher()
    row = compiler.allocate_bitmask(1)[0]
    for token in ours.encode('{"s": "', add_special_tokens=False):
        matcher.fill_bitmask(row)
        assert matcher.advance(token)
    matcher.fill_bitmask(row)  # inside a string: every printable byte, no padding
    allowed = [(int(row[i // 32]) >> (i % 32)) & 1 for i in range(320)]
    assert sum(allowed[:256]) > 90 and not any(allowed[261:])


def test_token_types_of_a_hand_made_vocabulary():
    """UNKNOWN reads as CONTROL, UNDEFINED as UNUSED, in the middle of the vocabulary too."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    kinds = gguf.TokenType
    tokens = [*alphabet, "<unk>", "[PAD257]", "<|end|>", "<tool>", "odd"]
    types = [kinds.NORMAL] * 256 + [kinds.UNKNOWN, kinds.UNUSED, kinds.CONTROL, kinds.USER_DEFINED, 0]  # 0: UNDEFINED
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                        "tokenizer.ggml.token_type": [int(t) for t in types],
                                        "tokenizer.ggml.eos_token_id": 258})
    a = alphabet.index("a")
    ids = [a, 256, 257, 258, 259, 260, a]
    assert tok.decode(ids) == "a<tool>a"
    assert tok.decode(ids, skip_special_tokens=False) == "a<unk><|end|><tool>a"
    assert tok.vocab_size == 261 and tok.special_ids == {256, 258}
    assert tok.encode("<tool>odd[PAD257]<|end|>", add_special_tokens=False) == (
        [259] + [alphabet.index(c) for c in "odd[PAD257]"] + [258])
    with pytest.raises(ValueError, match="token types for"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                                      "tokenizer.ggml.token_type": [1, 1]})


def test_a_sampled_padded_id_writes_no_text(tiny_qwen3_gguf):
    """The served GGUF model forced (logit_bias) to sample padded ids: the ids come back, the text
    holds only the real tokens between them."""
    loaded = load_model(str(tiny_qwen3_gguf), dtype=torch.float32)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=16, block_size=8, max_seq_len=128))
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias=((300, 100.0),), ignore_eos=True)
    engine.add_request(EngineRequest("r", loaded.tokenizer.encode("hello", add_special_tokens=False), params))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == [300] * 8 and "".join(o.new_text for o in outs) == ""
    assert engine.blocks.num_used_blocks() == 0
