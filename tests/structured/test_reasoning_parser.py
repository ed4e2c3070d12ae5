"""The qwen3 reasoning parser on known text: what goes to reasoning and to content, the same for any
chunking of a stream, and which models get it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mindie.config_keys import ConfigError
from mindie.structured.reasoning_parser import Phase, ReasoningSplitter, ThinkTags, reasoning_tags, split_reasoning
from mindie.tokenizer import Tokenizer

TAGS = ThinkTags()

# (output, whether the prompt opened a think block, reasoning, content)
CASES = [
    ("The answer is 4.", False, None, "The answer is 4."),  # no tags: unchanged
    ("", False, None, ""),
    ("<think>\nTwo and two.\n</think>\n\nThe answer is 4.", False, "\nTwo and two.\n", "\n\nThe answer is 4."),
    ("<think>\n\n</think>\n\nFour.", False, "\n\n", "\n\nFour."),
    ("<think>all reasoning</think>", False, "all reasoning", None),  # nothing after it: null, as vLLM
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", None),
    ("<think>a</think>b<think>c</think>d", False, "a", "b<think>c</think>d"),  # only the first block counts
    ("Hi <think>x</think> there", False, "x", "Hi  there"),
    ("a < b and </think> alone", False, None, "a < b and </think> alone"),  # an end tag without a start
    ("reasoning begun in the prompt</think>Four.", True, "reasoning begun in the prompt", "Four."),
    ("still thinking", True, "still thinking", None),
    ("</think>Four.", True, None, "Four."),
]


@pytest.mark.parametrize("output,opened,reasoning,content", CASES)
def test_whole_output(output, opened, reasoning, content):
    assert split_reasoning(TAGS, output, Phase.INSIDE if opened else Phase.BEFORE) == (reasoning, content)


# A constrained reply (the grammar gated on the think tokens): a block opens only at the reply's first
# token, and after a block the prompt closed there is none. (output, phase, reasoning, content)
CONSTRAINED = [
    ("<think>why</think>{}", Phase.BEFORE, "why", "{}"),
    ('{"a": "<think>x</think>"}', Phase.BEFORE, None, '{"a": "<think>x</think>"}'),  # text inside the answer
    ("<thin", Phase.BEFORE, None, "<thin"),  # held while it may become the tag, content once it cannot
    ("<think", Phase.BEFORE, None, "<think"),
    ("", Phase.BEFORE, None, ""),
    ("<think>x</think>", Phase.AFTER, None, "<think>x</think>"),
    ("why</think>{}", Phase.INSIDE, "why", "{}"),
]


def chunked(output: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(0, 6)))) if output else []
    return [output[i:j] for i, j in zip([0, *cuts], [*cuts, len(output)])]


def streamed(splitter: ReasoningSplitter, chunks: list[str]) -> tuple[str, str]:
    pieces = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
    return "".join(p.text for p in pieces if p.reasoning), "".join(p.text for p in pieces if not p.reasoning)


@pytest.mark.parametrize("output,opened,reasoning,content", CASES)
def test_any_chunking_of_a_stream_splits_as_the_whole(output, opened, reasoning, content):
    rng = random.Random(len(output))
    for _ in range(50):
        splitter = ReasoningSplitter(TAGS, Phase.INSIDE if opened else Phase.BEFORE)
        assert streamed(splitter, chunked(output, rng)) == (reasoning or "", content or "")


@pytest.mark.parametrize("output,phase,reasoning,content", CONSTRAINED)
def test_a_constrained_reply_opens_a_block_only_at_its_start(output, phase, reasoning, content):
    assert split_reasoning(TAGS, output, phase, opens_late=False) == (reasoning, content)
    rng = random.Random(len(output))
    for _ in range(50):
        splitter = ReasoningSplitter(TAGS, phase, opens_late=False)
        assert streamed(splitter, chunked(output, rng)) == (reasoning or "", content or "")


def test_a_cut_tag_is_held_back_until_it_is_one():
    splitter = ReasoningSplitter(TAGS, Phase.BEFORE)
    assert [p.text for p in splitter.feed("ok <thi")] == ["ok "]
    assert [(p.text, p.reasoning) for p in splitter.feed("nk>why")] == [("why", True)]
    assert splitter.feed("</") == []
    assert [(p.text, p.reasoning) for p in splitter.feed("b>")] == [("</b>", True)]  # not the end tag after all
    assert [(p.text, p.reasoning) for p in splitter.feed("</think")] == []
    assert [(p.text, p.reasoning) for p in splitter.feed(">4")] == [("4", False)]
    assert splitter.finish() == []


def _tokenizer(tmp_path: Path, plain: tuple[str, ...]) -> Tokenizer:
    from helpers.tiny_models import QWEN3_SPECIALS, QWEN3_TOKENIZER, write_byte_tokenizer

    tmp_path.mkdir()
    write_byte_tokenizer(tmp_path, QWEN3_SPECIALS, plain, QWEN3_TOKENIZER)
    return Tokenizer.from_hf_dir(str(tmp_path))


def test_which_models_get_the_parser(tmp_path):
    with_tags = _tokenizer(tmp_path / "a", ("<think>", "</think>"))
    without = _tokenizer(tmp_path / "b", ())
    ids = ThinkTags(TAGS.start, TAGS.end, with_tags.backend.token_to_id("<think>"),
                    with_tags.backend.token_to_id("</think>"))
    assert ids.start_id is not None and ids.end_id is not None
    assert reasoning_tags("auto", "qwen3", with_tags) == ids
    assert reasoning_tags("auto", "qwen3", without) is None
    assert reasoning_tags("auto", "llama", with_tags) is None  # by default only Qwen3
    assert reasoning_tags("qwen3", "llama", with_tags) == ids  # named: any model with the tokens
    assert reasoning_tags("none", "qwen3", with_tags) is None
    with pytest.raises(ConfigError, match="no <think> / </think> tokens"):
        reasoning_tags("qwen3", "qwen3", without)
    with pytest.raises(ConfigError, match="must be one of"):
        reasoning_tags("deepseek_r1", "qwen3", with_tags)


def test_a_prompt_opens_a_block_when_its_last_start_tag_is_unclosed():
    assert TAGS.opened_by("<|im_start|>assistant\n<think>\n")
    assert not TAGS.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not TAGS.opened_by("<|im_start|>assistant\n")


def test_where_a_reply_starts():
    assert TAGS.reply_phase("<|im_start|>assistant\n<think>\n") is Phase.INSIDE
    assert TAGS.reply_phase("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Phase.AFTER  # thinking off
    assert TAGS.reply_phase("<|im_start|>assistant\n") is Phase.BEFORE
    # an earlier turn's closed block (a tool-call round) leaves this reply free to think
    assert TAGS.reply_phase("<think>a</think>call<|im_end|>\n<|im_start|>assistant\n") is Phase.BEFORE
