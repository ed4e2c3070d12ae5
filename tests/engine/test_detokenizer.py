"""IncrementalDetokenizer: streamed deltas, split characters, special tokens and stop strings."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from mindie.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from mindie.tokenizer import Tokenizer

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Crème brûlée, naïve café, Ångström, façade, œuvre, straße.",
    "中文测试：你好，世界！日本語のテキストです。한국어 문장입니다.",
    "Emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵.",
    "Mixed\nnew\r\nlines\n\n\ttabs   and  spaces \n",
    "Ωμέγα, Русский текст, עברית, العربية, हिन्दी, ภาษาไทย",
    "def f(x):\n    return x ** 2  # 平方 ✓\n",
    "数字 12345 and 3.14159, €100, ¥200, £5, ½ ⅓ → ∞",
    "🙂",
    "a",
]


@pytest.fixture(scope="module")
def tok(smollm_tokenizer: Tokenizer) -> Tokenizer:
    """The embedded SmolLM2 tokenizer: byte-level BPE."""
    return smollm_tokenizer


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A tiny SentencePiece-style tokenizer: "▁" spaces, byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁Hello", "▁world", "▁Hi", "▁there", "!", "▁"]:
        vocab[w] = len(vocab)
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(backend, 1, (2,), True, None)


def stream(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    prompt: Sequence[int] = (),
    chunk_sizes: Sequence[int] | None = None,
    **kw,
) -> tuple[IncrementalDetokenizer, list[DetokenizerDelta], str]:
    """Feeds `ids` (one at a time, or in the given chunk sizes, cycled) until a stop matches or
    the ids run out; returns the detokenizer, the deltas and flush()'s text."""
    det = IncrementalDetokenizer(tokenizer, prompt, **kw)
    deltas: list[DetokenizerDelta] = []
    i, c = 0, 0
    while i < len(ids):
        n = chunk_sizes[c % len(chunk_sizes)] if chunk_sizes else 1
        c += 1
        d = det.append(ids[i : i + n])
        assert isinstance(d, DetokenizerDelta)
        deltas.append(d)
        i += n
        if d.stop_string is not None:
            break
    tail = det.flush()
    joined = "".join(d.text for d in deltas) + tail
    assert det.text == joined
    return det, deltas, tail


def first_stop_reference(full: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Naive reference: the first prefix of the whole text that contains a stop string is cut."""
    for end in range(1, len(full) + 1):
        hits = [s for s in stops if s and full.endswith(s, 0, end)]
        if hits:
            s = max(hits, key=len)
            return (full[:end] if include else full[: end - len(s)]), s
    return full, None


# --- plain streaming -------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    det, deltas, tail = stream(tok, ids)
    assert det.text == tok.decode(ids) == text
    assert det.num_tokens == len(ids)
    assert all(FFFD not in d.text for d in deltas) and FFFD not in tail
    assert all(d.stop_string is None for d in deltas)
    assert tail == ""  # complete text: nothing was left to release


@pytest.mark.parametrize("chunks", [[2], [3], [1, 4, 2], [100]])
def test_streaming_in_chunks(tok: Tokenizer, chunks: list[int]) -> None:
    text = "".join(TEXTS)
    ids = tok.encode(text, add_special_tokens=False)
    det, deltas, _ = stream(tok, ids, chunk_sizes=chunks)
    assert det.text == text
    assert det.num_tokens == len(ids)
    assert all(FFFD not in d.text for d in deltas)


def test_split_characters_are_held_back(tok: Tokenizer) -> None:
    text = "x😀世👨‍👩‍👧"
    ids = tok.encode(text, add_special_tokens=False)
    # The byte-level tokens really split these characters: some decode alone to U+FFFD.
    assert any(FFFD in tok.decode([i]) for i in ids)
    det, deltas, _ = stream(tok, ids)
    assert any(d.text == "" for d in deltas)  # something was held back
    assert all(FFFD not in d.text for d in deltas)
    assert det.text == text


def test_prompt_is_context_only(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nSay hi 😀<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("Hi there! 😀 café", add_special_tokens=False)
    det, _, _ = stream(tok, ids, prompt=prompt)
    assert det.text == "Hi there! 😀 café"
    # A prompt that ends in the middle of a character: the output is decoded on its own.
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    det, _, _ = stream(tok, emoji[1:], prompt=emoji[:1])
    assert det.text == tok.decode(emoji[1:])


def test_leading_space_uses_prompt_context(sp_tok: Tokenizer) -> None:
    v = sp_tok.backend.get_vocab()
    prompt = [1, v["▁Hi"]]
    ids = [v["▁there"], v["▁world"], v["!"]]
    det, _, _ = stream(sp_tok, ids, prompt=prompt)
    assert det.text == " there world!"  # the leading space survives, as in decode(prompt + ids)
    det, _, _ = stream(sp_tok, ids)
    assert det.text == sp_tok.decode(ids) == "there world!"


def test_byte_fallback_split_characters(sp_tok: Tokenizer) -> None:
    v = sp_tok.backend.get_vocab()
    text = "世😀é"
    ids = [v["▁Hello"]] + [v[f"<0x{b:02X}>"] for b in text.encode()] + [v["!"]]
    det, deltas, _ = stream(sp_tok, ids, prompt=[1])
    assert [d.text for d in deltas] == ["Hello", "", "", "世", "", "", "", "😀", "", "é", "!"]
    assert det.text == "Hello世😀é!"


def test_invalid_bytes_pass_through(tok: Tokenizer) -> None:
    # Lone UTF-8 continuation bytes (0x80) are garbage the model really produced: they come out
    # as U+FFFD, bounded in how long they are held, and the text still equals decode().
    byte_0x80 = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("\u0080")[0][0][1]
    cont = tok.backend.token_to_id(byte_0x80)
    assert cont is not None and tok.decode([cont]) == FFFD
    ids = [cont] * 20 + tok.encode(" ok", add_special_tokens=False)
    det, deltas, _ = stream(tok, ids)
    assert det.text == tok.decode(ids)
    assert det.text.count(FFFD) == 20
    assert FFFD in "".join(d.text for d in deltas[:10])  # not all held until the end
    # A trailing unfinished character is released by flush().
    emoji = tok.encode("ab😀", add_special_tokens=False)
    det, deltas, tail = stream(tok, emoji[:-1])
    assert all(FFFD not in d.text for d in deltas)
    assert tail.endswith(FFFD)
    assert det.text == tok.decode(emoji[:-1])


# --- special tokens --------------------------------------------------------------------------


def test_skip_special_tokens(tok: Tokenizer) -> None:
    im_end = tok.backend.token_to_id("<|im_end|>")
    eos = tok.backend.token_to_id("<|endoftext|>")
    assert {im_end, eos} <= tok.special_ids
    ids = (
        tok.encode("Hello", add_special_tokens=False)
        + [im_end]
        + tok.encode(" wörld 😀", add_special_tokens=False)
        + [eos]
    )
    det, _, _ = stream(tok, ids, skip_special_tokens=True)
    assert det.text == tok.decode(ids, skip_special_tokens=True) == "Hello wörld 😀"
    det, _, _ = stream(tok, ids, skip_special_tokens=False)
    assert det.text == tok.decode(ids, skip_special_tokens=False)
    assert det.text == "Hello<|im_end|> wörld 😀<|endoftext|>"
    # A special token alone produces no text (and no error).
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert det.append([eos]).text == ""
    assert det.flush() == "" and det.num_tokens == 1


# --- stop strings ----------------------------------------------------------------------------


def check_stop(
    tokenizer: Tokenizer,
    text: str,
    stops: Sequence[str],
    *,
    include: bool = False,
    chunk_sizes: Sequence[int] | None = None,
) -> tuple[IncrementalDetokenizer, list[DetokenizerDelta]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    expected, stop = first_stop_reference(full, stops, include)
    det, deltas, tail = stream(
        tokenizer, ids, chunk_sizes=chunk_sizes, stop=stops, include_stop_str_in_output=include
    )
    assert det.text == expected
    if stop is None:
        assert all(d.stop_string is None for d in deltas)
        assert det.stop_string is None and det.num_tokens == len(ids)
        return det, deltas
    assert tail == ""
    assert deltas[-1].stop_string == stop == det.stop_string
    assert all(d.stop_string is None for d in deltas[:-1])
    # No character of the matched stop string came out before the delta that matched it.
    start = len(expected) - len(stop) if include else len(expected)
    assert sum(len(d.text) for d in deltas[:-1]) <= start
    assert det.num_tokens <= len(ids)
    return det, deltas


def test_stop_single_token(tok: Tokenizer) -> None:
    text = "Hello world. Goodbye world."
    ids = tok.encode(text, add_special_tokens=False)
    assert "." in [tok.decode([i]) for i in ids]
    det, deltas = check_stop(tok, text, ["."])
    assert det.text == "Hello world"
    assert det.num_tokens == [tok.decode([i]) for i in ids].index(".") + 1


def test_stop_multi_token_and_spanning_boundaries(tok: Tokenizer) -> None:
    text = "The answer is forty-two, obviously. END OF ANSWER and more text"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # " OF ANS" starts and ends inside tokens.
    assert "OF ANS" not in pieces
    for stop in ["END OF ANSWER", "F ANS", "two, obv", "ly. E"]:
        det, _ = check_stop(tok, text, [stop])
        assert det.text == text[: text.index(stop)]
        det, _ = check_stop(tok, text, [stop], include=True)
        assert det.text == text[: text.index(stop) + len(stop)]


def test_stop_first_match_wins(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    det, _ = check_stop(tok, text, ["delta", "beta", "epsilon"])
    assert det.text == "alpha " and det.stop_string == "beta"
    # The one that completes first wins, even if another started earlier.
    det, _ = check_stop(tok, text, ["beta gamma", "ta g"])
    assert det.text == "alpha be" and det.stop_string == "ta g"
    # Of two ending at the same place, the one that starts first.
    det, _ = check_stop(tok, text, ["mma", "gamma"], include=True)
    assert det.text == "alpha beta gamma" and det.stop_string == "gamma"
    det, _ = check_stop(tok, text, ["mma", "gamma"])
    assert det.text == "alpha beta "


def test_stop_at_first_token(tok: Tokenizer) -> None:
    det, deltas = check_stop(tok, "Hello there", ["Hello"])
    assert det.text == "" and det.num_tokens == 1 and len(deltas) == 1
    det, deltas = check_stop(tok, "Hello there", ["He"], include=True)
    assert det.text == "He" and det.num_tokens == 1
    det, deltas = check_stop(tok, "Hello there", ["H"])
    assert det.text == ""


def test_stop_with_non_ascii(tok: Tokenizer) -> None:
    text = "Résumé: 世界 😀 fin 🎉 end"
    for stop in ["界 😀", "😀", "🎉 e", "é:"]:
        check_stop(tok, text, [stop])
        check_stop(tok, text, [stop], include=True)


def test_stop_in_chunked_appends(tok: Tokenizer) -> None:
    text = "one two three four five six seven eight nine ten"
    for chunks in ([2], [3], [1, 5], [50]):
        det, deltas = check_stop(tok, text, ["four f", "x s"], chunk_sizes=chunks)
        assert det.text == "one two three "
        det, deltas = check_stop(tok, text, ["four f"], include=True, chunk_sizes=chunks)
        assert det.text == "one two three four f"


def test_held_prefix_is_released(tok: Tokenizer) -> None:
    text = "The end is near"
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], stop=["near the sea", "r!"])
    out = "".join(det.append([i]).text for i in ids)
    assert out == "The end is "  # "near" could still become "near the sea"
    assert det.text == out
    assert det.flush() == "near"
    assert det.text == text and det.stop_string is None
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.append(ids[:1])


def test_held_prefix_released_when_it_cannot_match(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert det.append(tok.encode("go ST", add_special_tokens=False)).text == "go "
    assert det.append(tok.encode("OW", add_special_tokens=False)).text == "STOW"
    assert det.text == "go STOW"


def test_after_stop(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["b"])
    ids = tok.encode("a b c d", add_special_tokens=False)
    d = det.append(ids)  # matches mid-batch: the rest of the batch is not consumed
    assert d == DetokenizerDelta("a ", "b")
    assert det.num_tokens == [tok.decode(ids[:n]) for n in range(len(ids) + 1)].index("a b")
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.append(ids[:1])
    assert det.text == "a "


def test_no_stops_hold_nothing(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["", ""])
    assert det.append(tok.encode("abc", add_special_tokens=False)).text == "abc"


# --- randomized ------------------------------------------------------------------------------

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "café",
    "naïve",
    "über",
    "世界",
    "你好",
    "日本",
    "😀",
    "🎉",
    "👍🏽",
    "αβγ",
    "ДА",
    "\n",
    "\n\n",
    "  ",
    "42",
    "3.14",
    ",",
    ".",
    "!",
    "?",
    "-",
    "stop",
    "STOP",
    "end",
    "ending",
    "<",
    ">",
    "##",
    "x",
]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 30)):
        w = rng.choice(WORDS)
        parts.append(w if rng.random() < 0.3 else " " + w)
    return "".join(parts)


def test_randomized_against_reference(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        text = random_text(rng)
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 8)])
            else:
                stops.append(rng.choice(["zzz", "stop!", "😀😀", "\n\n\n"]))
        include = rng.random() < 0.5
        chunks = None if rng.random() < 0.5 else [rng.randint(1, 4) for _ in range(3)]
        check_stop(tok, text, stops, include=include, chunk_sizes=chunks)
