"""The errors clients get: OpenAI's ``{"error": {...}}`` body with an HTTP status.

A message is written for the user and never holds exception text or paths: an unexpected
failure is logged with a fresh error id and the client gets only the id.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from pydantic import BaseModel

__all__ = [
    "ApiError",
    "ErrorDetail",
    "ErrorResponse",
    "engine_stopped",
    "head_timed_out",
    "internal_error",
    "quote",
    "shutting_down",
    "too_large",
]

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (4xx, 5xx), as OpenAI sends it."""

    error: ErrorDetail


class ApiError(Exception):
    """An error answered as :class:`ErrorResponse` JSON with an HTTP status (and ``headers``, e.g.
    ``Retry-After`` on a 429)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def internal_error(status: int, what: str, error: BaseException | None = None) -> ApiError:
    """Log ``error`` with a fresh id; the client gets ``what`` and the id, nothing more."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error id %s)", what, error_id, exc_info=(type(error), error, error.__traceback__) if error else None)
    return ApiError(status, f"{what} (error id {error_id}; the server log has the details)", "server_error")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry later", "server_error", code="shutting_down")


def engine_stopped() -> ApiError:
    return ApiError(
        503,
        "the generation engine is not running; the server log has the details",
        "server_error",
        code="engine_stopped",
    )


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes, max_body_bytes)",
        code="body_too_large",
    )


def body_timed_out(seconds: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {seconds:g} s (body_timeout)", code="body_timeout")


def head_timed_out(seconds: float) -> ApiError:
    return ApiError(
        408, f"the request line and headers did not arrive within {seconds:g} s (head_timeout)", code="head_timeout"
    )


def too_many_connections(limit: int) -> ApiError:
    return ApiError(
        503,
        f"the server holds {limit} connections already (max_connections): try again shortly",
        "server_error",
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )


def quote(value: Any, limit: int = 60) -> str:
    """A request value quoted back in an error message, cut short."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
