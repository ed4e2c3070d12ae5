"""The HTTP responses every route shares: compact JSON bodies, and errors in a family's shape."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from mindie.server.errors import APIError, ErrorStyle
from mindie.server.protocols.base import dumps


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj).encode(), status_code=status, media_type="application/json")


def error_response(err: APIError, style: ErrorStyle) -> Response:
    return JSONResponse(err.body(style), status_code=err.status, headers=err.headers)
