"""Every API family, in the order their routes are matched: vLLM's `/generate` before TGI's, as a
body with `prompt` is vLLM's even when it also has `inputs`."""

from __future__ import annotations

from dataclasses import dataclass

from mindie.server.errors import ErrorStyle
from mindie.server.protocols import native, openai_family, tgi, triton, vllm
from mindie.server.protocols.family import Family, Kind, Route

FAMILIES: tuple[Family, ...] = (native.FAMILY, vllm.FAMILY, tgi.FAMILY, openai_family.FAMILY, triton.FAMILY)


@dataclass(frozen=True)
class Served:
    """One method and path, and the families' routes that serve it: one, or several told apart by
    their bodies (`Route.claims`)."""

    method: str
    path: str
    kind: Kind
    candidates: tuple[tuple[Family, Route], ...]

    @property
    def style(self) -> ErrorStyle:
        family, route = self.candidates[0]
        return family.style_of(route)


def served() -> list[Served]:
    grouped: dict[tuple[str, str], list[tuple[Family, Route]]] = {}
    for family in FAMILIES:
        for route in family.routes:
            grouped.setdefault((route.method, route.path), []).append((family, route))
    out = []
    for (method, path), candidates in grouped.items():
        kinds = {route.kind for _, route in candidates}
        assert len(kinds) == 1 and (len(candidates) == 1 or all(r.claims for _, r in candidates)), (method, path)
        out.append(Served(method, path, kinds.pop(), tuple(candidates)))
    return out
