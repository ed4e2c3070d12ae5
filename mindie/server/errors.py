"""Errors as each API family reports them.

An `APIError` carries a status, a message naming the field and its allowed range, and the field.
MindIE's own routes (native, TGI, vLLM /generate, Triton) answer `{"error", "error_type"}`;
OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

# MindIE's error_type per status (http_rest_resource.h)
_MINDIE_TYPES = {
    400: "Bad Request", 401: "Unauthorized", 404: "NotFoundError", 413: "Request Entity Too Large",
    415: "Unsupported Media Type",
    422: "Input Validation Error", 424: "Generation Error", 429: "Too Many Requests",
    500: "Incomplete Generation", 503: "Service Unavailable",
}
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 503: "server_error",
}

# OpenAI's `code` is a string or null (openai-python reads Optional[str]): the names OpenAI uses
# where a status has one, null for the rest (the message and `param` say what was wrong).
_OPENAI_CODES = {
    401: "invalid_api_key", 404: "not_found", 413: "request_too_large", 415: "unsupported_media_type",
    429: "rate_limit_exceeded", 503: "service_unavailable",
}


class ErrorStyle(enum.Enum):
    MINDIE = "mindie"
    OPENAI = "openai"


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    def body(self, style: ErrorStyle) -> dict[str, Any]:
        if style is ErrorStyle.OPENAI:
            return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "server_error"),
                              "param": self.param, "code": _OPENAI_CODES.get(self.status)}}
        return {"error": self.message, "error_type": _MINDIE_TYPES.get(self.status, "Incomplete Generation")}

    def for_style(self, style: ErrorStyle) -> APIError:
        """Validation failures are 422 on MindIE's routes and 400 on OpenAI's."""
        if style is ErrorStyle.OPENAI and self.status == 422:
            return APIError(400, self.message, self.param, self.headers)
        return self


def validation_error(message: str, param: str | None = None) -> APIError:
    return APIError(422, message, param)
