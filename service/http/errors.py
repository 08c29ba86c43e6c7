"""Errors the front door returns, in OpenAI's shape, and the mapping from their causes.

Every failure a client can see goes through `APIError` (or one of aiohttp's HTTP
exceptions, translated by `error_middleware`), so the body is always
``{"error": {"message", "type", "param", "code"}}`` with the right status.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from scheduler.sampling import SamplingParamsError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# OpenAI's error "type" for each status we return.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request failed in a way the client should be told about."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error object."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> web.Response:
        """A JSON response carrying this error."""
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for a status; `code` defaults to the status's name."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else str(status),
        }
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param)


def unsupported_media_type(content_type: str) -> APIError:
    """A 415 for a JSON route given another Content-Type."""
    return APIError(
        415,
        "request body must be JSON (Content-Type: application/json), got Content-Type "
        f"{content_type!r}",
        code="unsupported_media_type",
    )


def from_sampling_error(exc: SamplingParamsError) -> APIError:
    """Out-of-range sampling parameter -> 400 naming the field."""
    return APIError(400, str(exc), param=exc.param)


def _field_name(loc: tuple[int | str, ...]) -> str:
    """`('messages', 0, 'content', 'str')` -> `messages[0].content` (union member tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif any(c in part for c in "[]() ") or part in ("str", "int", "float", "bool"):
            break  # pydantic names union members after their type: the field ends here
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """Pydantic errors -> a 400 whose message names the first offending field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = _field_name(first["loc"])
    if first["type"] == "missing":
        return APIError(400, f"'{field}' is a required field", param=field)
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{field}'", param=field)
    same_field = [e for e in errors if _field_name(e["loc"]) == field]
    if len(same_field) > 1:
        # A union field: every alternative failed; list what was acceptable.
        message = (
            f"invalid value for '{field}': {first['input']!r:.80} does not match any accepted type"
        )
    else:
        message = f"invalid value for '{field}': {first['msg']} (got {first['input']!r:.80})"
    return APIError(400, message, param=field or None)


def request_error(exc: Exception) -> APIError | None:
    """The client's error a failure of request handling is, or None for a server fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, SamplingParamsError):
        return from_sampling_error(exc)
    return None


def _from_http_exception(exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(
            404,
            "route not found; see /v1/models, /v1/completions, /v1/chat/completions, "
            "/tokenize, /detokenize",
        )
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return APIError(405, f"method not allowed; allowed: {allowed}", headers={"Allow": allowed})
    if exc.status == 413:
        return APIError(413, f"request body too large: {exc.text or 'over the server limit'}")
    return APIError(exc.status, exc.reason or exc.text or "request failed")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI-shaped JSON error (unless a stream already began)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).response()
    except Exception as exc:
        error = request_error(exc)
        if error is not None:
            return error.response()
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error; see the server log").response()
