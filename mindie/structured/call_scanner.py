"""Incremental scan of one JSON candidate for tool calls, for :mod:`mindie.structured.tool_parser`.

A candidate is an object or a list of objects. An object is a call once it has a string "name"
(one of ``tool_names``, when given) and an "arguments" or "parameters" value has begun; until then
its keys must be call keys (name, arguments, parameters, type, id). The arguments are reported as
the model wrote them: an object's (or any non-string value's) raw text as it streams in, a string's
decoded value when it closes. The JSON is checked only for structure (brackets, strings, commas
and colons); scalars are runs of letters, digits and ``+-.``.

Each character is looked at a bounded number of times: strings, whitespace and scalars are
skipped with ``re.search`` over a single character class, which cannot backtrack.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection

CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})
SCANNING, DONE, FAILED = range(3)

NOT_WS = re.compile(r"[^ \t\n\r]")
STRING_STOP = re.compile(r'["\\]')
_NOT_SCALAR = re.compile(r"[^A-Za-z0-9.+\-]")
_WS = " \t\n\r"
_SCALAR_START = frozenset("-0123456789tfn")
_CLOSER = {"{": "}", "[": "]"}
# What comes next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)
# Progress of the current call's arguments.
_ARGS_NONE, _ARGS_IN, _ARGS_DONE = range(3)


class CallScanner:
    """``start`` a candidate at its "{" or "[", then ``scan`` each chunk and ``end_chunk`` it.
    Calls are reported through ``on_call(name)`` then ``on_arguments(fragment)`` (zero or more).
    ``status`` becomes DONE when the candidate closes with at least one call, FAILED when it
    cannot be (more) calls: scanning as text resumes at the index ``scan`` returned."""

    def __init__(
        self,
        tool_names: Collection[str] | None,
        on_call: Callable[[str], None],
        on_arguments: Callable[[str], None],
    ) -> None:
        self._names = None if tool_names is None else frozenset(tool_names)
        self._on_call = on_call
        self._on_arguments = on_arguments
        self.status = DONE
        self.committed = False  # the candidate holds a call
        self._stack: list[str] = []
        self._expect = _VALUE
        self._depth = 1  # of the call objects: 1 for a bare object, 2 inside a list
        self._in_string = self._str_is_key = self._escape = self._in_scalar = False
        self._str_role: str | None = None  # "key" / "name" / "args": a string whose value we need
        self._str_pieces: list[str] = []
        self._str_from = 0
        self._new_call()

    def _new_call(self) -> None:
        self._key: str | None = None
        self._name: str | None = None
        self._args = _ARGS_NONE
        self._args_string = False
        self._args_from = 0
        self._args_pieces: list[str] = []  # arguments seen before the name
        self._call = False  # the current object is a reported call

    def start(self, c: str) -> None:
        self._stack = [c]
        self._depth = 1 if c == "{" else 2
        self._expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        self._in_string = self._escape = self._in_scalar = False
        self.status, self.committed = SCANNING, False
        self._new_call()

    def end_chunk(self, s: str) -> None:
        """Passes on what of this chunk belongs to an unfinished value; the next chunk starts at 0."""
        if self._args == _ARGS_IN and not self._args_string:
            self._arguments(s[self._args_from :])
        if self._in_string and self._str_role is not None:
            self._str_pieces.append(s[self._str_from :])
        self._args_from = self._str_from = 0

    def scan(self, s: str, i: int) -> int:
        n = len(s)
        while i < n and self.status == SCANNING:
            if self._in_string:
                i = self._string(s, i)
                continue
            if self._in_scalar:
                m = _NOT_SCALAR.search(s, i)
                if m is None:
                    return n
                self._in_scalar = False
                i = m.start()
                self._value_end(s, i)
                continue
            c = s[i]
            if c in _WS:
                m = NOT_WS.search(s, i)
                i = n if m is None else m.start()
                continue
            expect = self._expect
            if expect == _COLON:
                if c != ":":
                    return self._fail(s, i)
                self._expect = _VALUE
                i += 1
            elif expect == _COMMA_OR_CLOSE:
                top = self._stack[-1]
                if c == ",":
                    self._expect = _KEY if top == "{" else _VALUE
                    i += 1
                elif c == _CLOSER[top]:
                    i = self._close(s, i)
                else:
                    return self._fail(s, i)
            elif expect == _KEY or expect == _KEY_OR_CLOSE:
                if c == '"':
                    self._start_string(i, True, "key" if len(self._stack) == self._depth else None)
                    i += 1
                elif c == "}" and expect == _KEY_OR_CLOSE:
                    i = self._close(s, i)
                else:
                    return self._fail(s, i)
            elif c == "]" and expect == _VALUE_OR_CLOSE:
                i = self._close(s, i)
            elif c in '{["' or c in _SCALAR_START:
                i = self._value_start(s, i, c)
            else:
                return self._fail(s, i)
        return i

    def _value_start(self, s: str, i: int, c: str) -> int:
        depth, role = len(self._stack), None
        if depth == 1 and self._depth == 2:  # an element of a list of calls
            if c != "{":
                return self._fail(s, i)
            self._new_call()
        elif depth == self._depth:  # a member of a call object
            if self._key == "name" and self._name is None:
                if c != '"':
                    return self._fail(s, i)
                role = "name"
            elif self._key in ("arguments", "parameters") and self._args == _ARGS_NONE:
                self._args, self._args_string, self._args_from = _ARGS_IN, c == '"', i
                role = "args" if c == '"' else None
                if self._name is not None:
                    self._report_call()
        if c == "{" or c == "[":
            self._stack.append(c)
            self._expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        elif c == '"':
            self._start_string(i, False, role)
        else:
            self._in_scalar = True
        return i + 1

    def _start_string(self, i: int, is_key: bool, role: str | None) -> None:
        self._in_string, self._str_is_key, self._str_role = True, is_key, role
        self._str_pieces, self._str_from = [], i + 1

    def _string(self, s: str, i: int) -> int:
        n = len(s)
        if self._escape:  # the previous chunk ended on a backslash
            self._escape = False
            i += 1
        while i < n:
            m = STRING_STOP.search(s, i)
            if m is None:
                return n
            j = m.start()
            if s[j] == "\\":
                self._escape = j + 1 == n
                i = j + 2
                continue
            self._in_string = False
            return self._string_end(s, j)
        return n

    def _string_end(self, s: str, j: int) -> int:
        role, k = self._str_role, j + 1
        value = ""
        if role is not None:
            raw = "".join(self._str_pieces) + s[self._str_from : j]
            self._str_pieces = []
            try:
                value = json.loads(f'"{raw}"', strict=False)
            except ValueError:
                return self._fail(s, k)
        if self._str_is_key:
            if role == "key":
                if value not in CALL_KEYS and not self._call:
                    return self._fail(s, k)
                self._key = value
            self._expect = _COLON
            return k
        if role == "name":
            if self._names is not None and value not in self._names:
                return self._fail(s, k)
            self._name = value
            if self._args != _ARGS_NONE:
                self._report_call()
        elif role == "args":
            self._arguments(value)
        self._value_end(s, k)
        return k

    def _close(self, s: str, i: int) -> int:
        self._stack.pop()
        j = i + 1
        if len(self._stack) == self._depth - 1 and not self._call:
            return self._fail(s, j)  # a call object without both a name and arguments
        self._value_end(s, j)
        return j

    def _value_end(self, s: str, j: int) -> None:
        depth = len(self._stack)
        if depth == self._depth and self._args == _ARGS_IN:
            if not self._args_string:
                self._arguments(s[self._args_from : j])
            self._args = _ARGS_DONE
        if depth > 0:
            self._expect = _COMMA_OR_CLOSE
        elif self.committed:
            self.status = DONE
        else:
            self._fail(s, j)  # e.g. an empty list

    def _fail(self, s: str, j: int) -> int:
        if self._call and self._args == _ARGS_IN and not self._args_string:
            self._arguments(s[self._args_from : j])
        self.status = FAILED
        self._in_string = self._in_scalar = False
        return j

    def _report_call(self) -> None:
        self._call = self.committed = True
        self._on_call(self._name or "")
        if self._args_pieces:
            self._on_arguments("".join(self._args_pieces))
            self._args_pieces = []

    def _arguments(self, text: str) -> None:
        if not text:
            return
        if self._call:
            self._on_arguments(text)
        else:
            self._args_pieces.append(text)
