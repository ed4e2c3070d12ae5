"""Tool-call parser: the recognised forms, content around calls, streaming = whole-text parse for
any chunking, and adversarial output that must stay linear-time and never raise."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from mindie.structured.tool_parser import (
    ContentDelta,
    Event,
    ParsedOutput,
    ToolCallArguments,
    ToolCallParser,
    ToolCallStart,
    join_events,
    parse_tool_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'

# (model output, content, [(name, arguments)])
CASES = [
    ("Hello, world.", "Hello, world.", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (
        'Let me look.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": [1, {"y": "}]"}]}}</tool_call>',
        "Let me look.",
        [("a", "{}"), ("b", '{"x": [1, {"y": "}]"}]}')],
    ),
    (WEATHER, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (
        '[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "parameters": {"z": "w\\"x"}}]',
        "",
        [("a", '{"q": 1}'), ("b", '{"z": "w\\"x"}')],
    ),
    ('{"type": "function", "name": "f", "parameters": {"k": null}}', "", [("f", '{"k": null}')]),
    ('{"arguments": {"k": true}, "name": "late"}', "", [("late", '{"k": true}')]),
    ('{"name": "s", "arguments": "{\\"a\\": 1}"}', "", [("s", '{"a": 1}')]),  # arguments as a JSON string
    (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>',
        "",
        [("a", "{}"), ("b", "{}")],
    ),
    # Ordinary JSON, brackets and tags that are not calls stay content, verbatim.
    ('Use {"a": 1} or {"name": "Bob", "age": 3}.', 'Use {"a": 1} or {"name": "Bob", "age": 3}.', []),
    ("see [1], [] and {} or { x }", "see [1], [] and {} or { x }", []),
    ("x <tool_call>garbage</tool_call> y", "x <tool_call>garbage</tool_call> y", []),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    ('{"name": 3, "arguments": {}}', '{"name": 3, "arguments": {}}', []),
    ("a < b and <tool_c", "a < b and <tool_c", []),
    # Whitespace touching a call: kept only as a separator between content.
    ('A {"name": "f", "arguments": {}} B', "A B", [("f", "{}")]),
    (f"\n\n{WEATHER}\n\n", "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (f"Sure.\n{WEATHER}", "Sure.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("  indented\n", "  indented\n", []),
    # A call cut off by the end of output keeps what it has; broken JSON after a call is text.
    ('{"name": "t", "arguments": {"a": 1', "", [("t", '{"a": 1')]),
    ('{"name": "t", "arguments": {"a": 1} oops', "oops", [("t", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", "{}")]),  # no close tag
    # A call nested in ordinary JSON is found once the outer object shows it is no call.
    ('{"x": {"name": "f", "arguments": {}}}', '{"x": }', [("f", "{}")]),
    ('{"name": "f", "arguments": {"s": "\\u00e9\\n<tool_call>"}}', "", [("f", '{"s": "\\u00e9\\n<tool_call>"}')]),
]


def calls_of(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def stream(text: str, sizes: list[int], tool_names: list[str] | None = None) -> list[Event]:
    parser = ToolCallParser(tool_names)
    events: list[Event] = []
    i = 0
    for size in sizes:
        events += parser.feed(text[i : i + size])
        i += size
    events += parser.feed(text[i:])
    return events + parser.finish()


def check_event_order(events: list[Event]) -> None:
    """Each call opens with its start (index, id, name), then argument fragments; indices count up."""
    started: list[int] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(started)
            started.append(e.index)
        elif isinstance(e, ToolCallArguments):
            assert started and e.index == started[-1] and e.arguments
        else:
            assert e.text


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse(text, content, calls):
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    for call in parsed.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_equals_whole_for_any_chunking(text, content, calls):
    rng = random.Random(len(text))
    chunkings = [[1] * len(text), [rng.randint(1, 7) for _ in range(len(text))], [len(text) // 2]]
    for sizes in chunkings:
        events = stream(text, sizes)
        check_event_order(events)
        joined = join_events(events)
        assert (joined.content, calls_of(joined)) == (content, calls)


def test_streamed_arguments_arrive_as_they_are_generated():
    parser = ToolCallParser()
    assert parser.feed('<tool_call>{"name": "get_weather", ') == []
    start, fragment = parser.feed('"arguments": {"city": "Pa')
    assert isinstance(start, ToolCallStart) and start.name == "get_weather" and start.index == 0
    assert fragment == ToolCallArguments(0, '{"city": "Pa')
    assert parser.feed('ris"}}</tool_call>') == [ToolCallArguments(0, 'ris"}')]
    assert parser.feed("\nDone.") == [ContentDelta("Done.")]
    assert parser.finish() == []
    assert start.to_openai_delta() == {
        "index": 0, "id": start.id, "type": "function", "function": {"name": "get_weather", "arguments": ""}
    }
    assert fragment.to_openai_delta() == {"index": 0, "function": {"arguments": '{"city": "Pa'}}


def test_openai_message_form():
    (call,) = parse_tool_calls(WEATHER).tool_calls
    assert call.to_openai() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}


def test_tool_names_filter_unknown_calls_into_content():
    text = '{"name": "rm_rf", "arguments": {}} then {"name": "ok", "arguments": {}}'
    parsed = parse_tool_calls(text, tool_names=["ok"])
    assert calls_of(parsed) == [("ok", "{}")]
    assert parsed.content == '{"name": "rm_rf", "arguments": {}} then'
    assert join_events(stream(text, [1] * len(text), ["ok"])).content == parsed.content


FRAGMENTS = [
    "Hello", " ", "\n", "{", "}", "[", "]", '"', "\\", ":", ",", "<tool_call>", "</tool_call>", "<tool_",
    "<", '{"name": "f", "arguments": ', '{"a": [1, "x\\"}"]}', '"name"', '"arguments"', "null", "é",
    WEATHER, f"<tool_call>{WEATHER}</tool_call>", '[{"name": "g", "parameters": {}}]', "\\u00", "  ",
]


@pytest.mark.parametrize("seed", range(200))
def test_random_output_never_raises_and_streams_consistently(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
    whole = parse_tool_calls(text)
    for sizes in ([1] * len(text), [rng.randint(1, 12) for _ in range(len(text))]):
        events = stream(text, sizes)
        check_event_order(events)
        joined = join_events(events)
        assert (joined.content, calls_of(joined)) == (whole.content, calls_of(whole))


ADVERSARIAL = {
    "500 KB of open tags": "<tool_call>" * (500_000 // len("<tool_call>")),
    "500 KB of tag prefixes": "<tool_cal" * (500_000 // 9),
    "unbalanced open braces": "{" * 500_000,
    "unbalanced brace-quotes": '{"' * 250_000,
    "unbalanced closers": "}]" * 250_000,
    "nested lists of objects": "[{" * 250_000,
    "escaped quotes in arguments": '{"name": "f", "arguments": {"a": "' + '\\"' * 200_000 + '"}}',
    "a run of backslashes": '{"name": "f", "arguments": {"a": "' + "\\" * 300_001,
    "deep nesting in arguments": '{"name": "f", "arguments": ' + "[" * 200_000 + "]" * 200_000 + "}",
    "deep nesting, never closed": '<tool_call>{"name": "f", "arguments": ' + '{"a": ' * 60_000,
    "tags around quotes": '<tool_call>{"name": "' * 20_000,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_output_is_fast_and_never_raises(name):
    text = ADVERSARIAL[name]
    # The best of three: a quadratic parse takes minutes on every try, while a busy neighbour
    # (the suite's own servers winding down on two cores) slows one try past the bound.
    elapsed = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        parsed = parse_tool_calls(text)
        elapsed = min(elapsed, time.perf_counter() - start)
    assert elapsed < 1.0, f"{name}: {elapsed:.2f} s"
    assert len(parsed.content) + sum(len(c.arguments) for c in parsed.tool_calls) <= len(text)


@pytest.mark.parametrize("name", ["500 KB of open tags", "unbalanced brace-quotes", "escaped quotes in arguments"])
def test_adversarial_output_streamed_in_tokens(name):
    text = ADVERSARIAL[name][:100_000]
    rng = random.Random(0)
    start = time.perf_counter()
    events = stream(text, [rng.randint(1, 8) for _ in range(len(text) // 4)])
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{name}: {elapsed:.2f} s"
    joined, whole = join_events(events), parse_tool_calls(text)
    assert (joined.content, calls_of(joined)) == (whole.content, calls_of(whole))
