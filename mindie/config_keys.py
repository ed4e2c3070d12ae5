"""The one checker of configuration keys: `config.json` (server/config.py), its engine keys
(config.py) and `ms_coordinator.json` (coordinator/config.py) describe each key as a `Key` and
check a section with `check_section`, so a key means the same and is refused with the same words
wherever it appears. A refusal names the key's path, its type and its range."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    pass


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_dns_name(value: str) -> bool:
    """A host name as RFC 1123 has it: dot-separated labels of letters, digits and inner hyphens,
    63 characters each, 253 in all, one trailing dot allowed. A last label of digits only is
    refused: such a name reads as a mistyped IPv4 address (`10.0.0.300`)."""
    labels = value.removesuffix(".").split(".")
    return (len(value.removesuffix(".")) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())


@dataclass(frozen=True)
class Key:
    """A key's type, range and default. Kinds: "int", "num" (int or float), "bool", "str", "ip",
    "host" (an IP address or a DNS name), "port" (an integer, or MindIE's digit string),
    "numstr" (a number, or one written as a string), "dict", "list"; "int|bool" takes either."""

    kind: str
    default: Any = _MISSING  # filled in when the key is absent; no default: absent stays absent
    lo: float | None = None
    hi: float | None = None
    choices: tuple[Any, ...] | None = None
    honoured: bool = True  # False: accepted so a MindIE file loads, without effect here

    def _range(self) -> str:
        def bound(v: float) -> str:
            return str(int(v)) if float(v).is_integer() else str(v)

        return f" in [{bound(self.lo)}, {bound(self.hi)}]" if self.lo is not None and self.hi is not None else ""

    def parse(self, path: str, value: Any) -> Any:
        """The value as the configuration means it (a port string as an integer); ConfigError when
        it is of another type or out of range."""
        kinds = self.kind.split("|")
        if "bool" in kinds and isinstance(value, bool):
            return self._chosen(path, value)
        if kinds[0] in ("str", "ip", "host"):
            return self._text(path, value)
        if kinds[0] in ("dict", "list"):
            if not isinstance(value, dict if kinds[0] == "dict" else list):
                raise ConfigError(f"{path} must be {'an object' if kinds[0] == 'dict' else 'a list'}, got {value!r}")
            return value
        if kinds == ["bool"]:
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return self._chosen(path, self._number(path, value, kinds[0]))

    def _chosen(self, path: str, value: Any) -> Any:
        if self.choices is not None and value not in self.choices:
            if len(self.choices) == 1:
                raise ConfigError(f"{path} can only be {json.dumps(self.choices[0])} here, got {json.dumps(value)}")
            raise ConfigError(f"{path} must be one of {list(self.choices)}, got {value!r}")
        return value

    def _text(self, path: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        if self.kind == "ip" and not is_ip(value):
            raise ConfigError(f"{path} must be an IP address, got {value!r}")
        if self.kind == "host" and not (is_ip(value) or is_dns_name(value)):
            raise ConfigError(f"{path} must be an IP address or a DNS name, got {value!r}")
        return self._chosen(path, value)

    def _number(self, path: str, value: Any, kind: str) -> int | float:
        rule = self._range()
        integer = kind in ("port", "int")
        number: float
        if kind in ("port", "numstr") and isinstance(value, str):
            try:
                number = float(value) if kind == "numstr" else int(value, 10)
            except ValueError:
                raise ConfigError(f"{path} must be a number{rule}, got {value!r}") from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            raise ConfigError(f"{path} must be {'an integer' if integer else 'a number'}{rule}, got {value!r}")
        if integer and number != int(number):
            raise ConfigError(f"{path} must be an integer{rule}, got {value!r}")
        if (self.lo is not None and number < self.lo) or (self.hi is not None and number > self.hi):
            raise ConfigError(f"{path} must be{rule}, got {value!r}")
        return int(number) if integer else number


def check_section(path: str, section: Any, keys: dict[str, Key], ignored: list[str]) -> dict[str, Any]:
    """The section's values, parsed, with the defaults of absent keys that have one. An unknown key
    is refused with the known ones; a key without effect here is added to `ignored`."""
    prefix = f"{path}." if path else ""
    if not isinstance(section, dict):
        raise ConfigError(f"{path or 'the configuration'} must be an object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}; known keys of {path or 'the top level'}: "
                          f"{', '.join(sorted(keys))}")
    out = {}
    for key, spec in keys.items():
        if key in section:
            out[key] = spec.parse(prefix + key, section[key])
            if not spec.honoured:
                ignored.append(prefix + key)
        elif spec.default is not _MISSING:
            out[key] = spec.parse(prefix + key, spec.default)
    return out
