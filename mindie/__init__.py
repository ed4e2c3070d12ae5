"""mindie: an open, MindIE-compatible LLM inference server."""

from __future__ import annotations

__version__ = "0.1.0"
