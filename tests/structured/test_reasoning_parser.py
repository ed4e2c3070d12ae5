"""The qwen3 reasoning parser on known text: what goes to reasoning and to content, the same for any
chunking of a stream, and which models get it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mindie.config_keys import ConfigError
from mindie.structured.reasoning_parser import ReasoningSplitter, ThinkTags, reasoning_tags, split_reasoning
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
    assert split_reasoning(TAGS, output, opened) == (reasoning, content)


@pytest.mark.parametrize("output,opened,reasoning,content", CASES)
def test_any_chunking_of_a_stream_splits_as_the_whole(output, opened, reasoning, content):
    rng = random.Random(len(output))
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(0, 6)))) if output else []
        chunks = [output[i:j] for i, j in zip([0, *cuts], [*cuts, len(output)])]
        splitter = ReasoningSplitter(TAGS, opened)
        pieces = [p for c in chunks for p in splitter.feed(c)] + splitter.finish()
        assert "".join(p.text for p in pieces if p.reasoning) == (reasoning or "")
        assert "".join(p.text for p in pieces if not p.reasoning) == (content or "")


def test_a_cut_tag_is_held_back_until_it_is_one():
    splitter = ReasoningSplitter(TAGS, False)
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
    assert reasoning_tags("auto", "qwen3", with_tags) == TAGS
    assert reasoning_tags("auto", "qwen3", without) is None
    assert reasoning_tags("auto", "llama", with_tags) is None  # by default only Qwen3
    assert reasoning_tags("qwen3", "llama", with_tags) == TAGS  # named: any model with the tokens
    assert reasoning_tags("none", "qwen3", with_tags) is None
    with pytest.raises(ConfigError, match="no <think> / </think> tokens"):
        reasoning_tags("qwen3", "qwen3", without)
    with pytest.raises(ConfigError, match="must be one of"):
        reasoning_tags("deepseek_r1", "qwen3", with_tags)


def test_a_prompt_opens_a_block_when_its_last_start_tag_is_unclosed():
    assert TAGS.opened_by("<|im_start|>assistant\n<think>\n")
    assert not TAGS.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not TAGS.opened_by("<|im_start|>assistant\n")
