"""Finds tool calls in model output, whole or streamed, in linear time; never executes anything.

Recognised calls: a JSON object with a string "name" and an "arguments" (or "parameters") value,
bare in the text or wrapped in <tool_call>...</tool_call> (Hermes / Qwen), alone or as a JSON array
of such objects. Before a call is recognised its object may hold only the keys name, arguments,
parameters, type and id, so ordinary JSON in an answer stays content. With ``tool_names``, only
calls to those names count. "arguments" is passed on as the model wrote it (an object's raw text,
or a string's decoded value); a call cut off by the end of output keeps the part it has.

Text outside calls is content, verbatim except for whitespace that touches a call: the run before a
call is kept only if content follows the call (it then separates the two), the run after is dropped.

One scanner serves both modes: :func:`parse_tool_calls` feeds the whole text at once, so a stream
of :class:`ToolCallParser` events joined with :func:`join_events` is the non-streamed parse for any
chunking. Each character is read a bounded number of times (``str`` methods, and regexes without
nested quantifiers, which cannot backtrack); text that may still start a call is held back only
until that is decided. JSON candidates are scanned by :mod:`mindie.structured.call_scanner`.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from mindie.structured.call_scanner import CALL_KEYS, DONE, NOT_WS, SCANNING, STRING_STOP, CallScanner

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"
# Where a call may start: the open tag, or "{" / "[" followed (after whitespace) by '"' / "{".
_START = re.compile(r'<tool_call>|\{[ \t\n\r]*"|\[[ \t\n\r]*\{')
# What the parser is reading: text, the open tag, the tag's body before its JSON, a JSON
# candidate, or the close tag after a tagged call.
_TEXT, _OPEN, _BODY, _JSON, _CLOSE = range(5)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        """An entry of an OpenAI message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """The first event of a call: its index in the response, id and name."""

    index: int
    id: str
    name: str

    def to_openai_delta(self) -> dict[str, Any]:
        """An entry of an OpenAI chunk's ``delta.tool_calls``."""
        function = {"name": self.name, "arguments": ""}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallArguments:
    """The next fragment of call ``index``'s arguments."""

    index: int
    arguments: str

    def to_openai_delta(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.arguments}}


Event = ContentDelta | ToolCallStart | ToolCallArguments


class ParsedOutput(NamedTuple):
    content: str
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> ParsedOutput:
    """The content and tool calls of a whole model output."""
    parser = ToolCallParser(tool_names)
    return join_events([*parser.feed(text), *parser.finish()])


def join_events(events: Iterable[Event]) -> ParsedOutput:
    """Content and calls as a non-streamed response carries them."""
    content: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls[e.index] = (e.id, e.name, [])
        else:
            calls[e.index][2].append(e.arguments)
    return ParsedOutput("".join(content), [ToolCall(cid, name, "".join(args)) for cid, name, args in calls.values()])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Incremental: ``feed(delta)`` for each piece of output, then ``finish()`` once; each returns
    the events that piece decided (adjacent ones merged)."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._events: list[Event] = []
        self._mode = _TEXT
        self._json_scanner = CallScanner(tool_names, self._on_call, self._on_arguments)
        self._num_calls = 0
        # Content whitespace (see the module docstring).
        self._ws_hold: list[str] = []  # trailing whitespace of the content so far, not yet sent
        self._deferred_ws = ""  # the run before the last call, sent if content follows it
        self._after_call = False  # drop whitespace: nothing but whitespace since the last call
        self._any_content = False
        # Text that may still turn out to be content, held from the candidate's first character.
        self._holding = False
        self._held: list[str] = []
        self._from = 0  # where the held part of the current chunk starts
        self._lit = 0  # characters of OPEN_TAG / CLOSE_TAG matched so far
        self._tagged = False

    def feed(self, text: str) -> list[Event]:
        s, i, n = text, 0, len(text)
        self._from = 0
        while i < n:
            mode = self._mode
            if mode == _TEXT:
                i = self._text(s, i)
            elif mode == _JSON:
                i = self._json(s, i)
            elif mode == _OPEN:
                i = self._open(s, i)
            elif mode == _BODY:
                i = self._body(s, i)
            else:
                i = self._close_tag(s, i)
        if self._holding:
            self._held.append(s[self._from :])
        if self._mode == _JSON:
            self._json_scanner.end_chunk(s)
        return self._take()

    def finish(self) -> list[Event]:
        if self._holding:  # an undecided candidate, or a cut-off tag: content after all
            self._content(self._release("", 0))
        if self._ws_hold and not self._after_call:
            self._events.append(ContentDelta("".join(self._ws_hold)))
        self._ws_hold = []
        self._mode = _TEXT
        return self._take()

    # --- text between calls ------------------------------------------------------------------

    def _text(self, s: str, i: int) -> int:
        start = i
        while True:
            m = _START.search(s, i)
            if m is None:
                j = _undecided_tail(s, i)
                break
            j = m.start()
            resume = _not_a_call(s, j)
            if resume is None:
                break
            i = resume
        if j > start:
            self._content(s[start:j])
        if j == len(s):
            return j
        self._hold(j)
        if s[j] == "<":
            self._mode, self._lit = _OPEN, 0
            return j
        self._tagged = False
        return self._start_json(s, j)

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
            self._ws_hold = [self._deferred_ws] if self._deferred_ws else []
            self._deferred_ws = ""
        body = text.rstrip(_WS)
        if not body:
            self._ws_hold.append(text)
            return
        self._events.append(ContentDelta("".join(self._ws_hold) + body))
        tail = text[len(body) :]
        self._ws_hold = [tail] if tail else []
        self._any_content = True

    def _hold(self, j: int) -> None:
        self._holding, self._held, self._from = True, [], j

    def _release(self, s: str, j: int) -> str:
        """Stops holding; returns the held text up to s[j]."""
        text = "".join(self._held) + s[self._from : j]
        self._holding, self._held = False, []
        return text

    # --- tags ------------------------------------------------------------------------------------

    def _literal(self, s: str, i: int, lit: str) -> tuple[int, bool | None]:
        """Matches lit[self._lit:] at s[i:]: (next index, True = whole, None = need more, False)."""
        k = self._lit
        n = min(len(lit) - k, len(s) - i)
        if s.startswith(lit[k : k + n], i):
            self._lit = k + n
            return i + n, (True if self._lit == len(lit) else None)
        t = 0
        while s[i + t] == lit[k + t]:
            t += 1
        return i + t, False

    def _open(self, s: str, i: int) -> int:
        i, ok = self._literal(s, i, OPEN_TAG)
        if ok:
            self._mode = _BODY
        elif ok is False:  # not a tag after all: what matched is content
            self._mode = _TEXT
            self._content(self._release(s, i))
        return i

    def _body(self, s: str, i: int) -> int:
        m = NOT_WS.search(s, i)
        if m is None:
            return len(s)
        j = m.start()
        if s[j] in "{[":
            self._tagged = True
            return self._start_json(s, j)
        self._mode = _TEXT
        self._content(self._release(s, j))
        return j

    def _close_tag(self, s: str, i: int) -> int:
        if self._lit == 0:
            m = NOT_WS.search(s, i)
            if m is None:
                return len(s)
            i = m.start()
            if s[i] != "<":
                self._mode = _TEXT
                return i
            self._hold(i)
        i, ok = self._literal(s, i, CLOSE_TAG)
        if ok:
            self._holding, self._held, self._mode = False, [], _TEXT
        elif ok is False:
            self._mode = _TEXT
            self._content(self._release(s, i))
        return i

    # --- JSON candidates -----------------------------------------------------------------------

    def _start_json(self, s: str, j: int) -> int:
        self._json_scanner.start(s[j])
        self._mode = _JSON
        return j + 1

    def _json(self, s: str, i: int) -> int:
        scanner = self._json_scanner
        i = scanner.scan(s, i)
        if scanner.status == SCANNING:
            return i
        self._mode, self._lit = _TEXT, 0
        if scanner.status == DONE:
            self._mode = _CLOSE if self._tagged else _TEXT
            self._after_call = True
        elif scanner.committed:  # broken after its calls: the rest is text
            self._after_call = True
        else:
            self._content(self._release(s, i))
        return i

    def _on_call(self, name: str) -> None:
        if self._holding:  # the candidate's first call: its text is no content
            self._holding, self._held = False, []
            if self._ws_hold:
                self._deferred_ws = "".join(self._ws_hold) if self._any_content else ""
                self._ws_hold = []
        self._num_calls += 1
        self._events.append(ToolCallStart(self._num_calls - 1, new_call_id(), name))

    def _on_arguments(self, text: str) -> None:
        self._events.append(ToolCallArguments(self._num_calls - 1, text))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return _merge(events)


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent content deltas as one event, and adjacent argument fragments of a call as one."""
    out: list[Event] = []
    i = 0
    while i < len(events):
        e, j = events[i], i + 1
        if isinstance(e, ContentDelta):
            while j < len(events) and isinstance(events[j], ContentDelta):
                j += 1
            out.append(ContentDelta("".join(x.text for x in events[i:j] if isinstance(x, ContentDelta))))
        elif isinstance(e, ToolCallArguments):
            while j < len(events) and isinstance(events[j], ToolCallArguments) and events[j].index == e.index:
                j += 1
            parts = (x.arguments for x in events[i:j] if isinstance(x, ToolCallArguments))
            out.append(ToolCallArguments(e.index, "".join(parts)))
        else:
            out.append(e)
        i = j
    return out


def _not_a_call(s: str, j: int) -> int | None:
    """A quick look at the candidate at s[j] (a match of _START): where the scanner would resume if
    it is plainly not a call (the first key is not a call key, a tag or list holds no object), or
    None if the full scan must decide. Resuming where the full scan would keeps the result the
    same however the text is chunked."""
    if s[j] == "<":
        m = NOT_WS.search(s, j + len(OPEN_TAG))
        return None if m is None or s[m.start()] in "{[" else m.start()
    if s[j] == "{":
        return _first_key(s, s.index('"', j))
    m = NOT_WS.search(s, s.index("{", j) + 1)  # "[" then "{": the first element
    if m is None or s[m.start()] == "}":
        return None
    return _first_key(s, m.start()) if s[m.start()] == '"' else m.start()


def _first_key(s: str, q: int) -> int | None:
    """s[q] opens an object's first key: past its closing quote if it is plainly no call key."""
    m = STRING_STOP.search(s, q + 1)
    if m is None or s[m.start()] == "\\" or s[q + 1 : m.start()] in CALL_KEYS:
        return None
    return m.start() + 1


def _undecided_tail(s: str, i: int) -> int:
    """Start of a tail of s[i:] that may begin a call once more text arrives: "{" or "[" followed
    only by whitespace, or a proper prefix of OPEN_TAG. len(s) if there is none."""
    n = len(s)
    body = len(s.rstrip(_WS))
    start = body - 1 if body > i and s[body - 1] in "{[" else n
    for k in range(min(len(OPEN_TAG) - 1, n - i), 0, -1):
        if s.endswith(OPEN_TAG[:k]):
            return min(start, n - k)
    return start
