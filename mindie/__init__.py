"""mindie: an open, MindIE-compatible LLM inference server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from mindie.engine.request import SamplingParams
    from mindie.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy, so `import mindie._C` or `mindie.ops` does not pull in the engine and its dependencies.
    if name == "LLM":
        from mindie.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mindie.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mindie' has no attribute {name!r}")
