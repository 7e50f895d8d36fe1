"""The front's errors: a core's ErrorReply (or a lost link, a deadline) as OpenAI's error
object and HTTP status, and the response that carries it."""

from __future__ import annotations

from starlette.responses import JSONResponse, Response

from memstep.api.client import ROUTE_LOST, ServerError
from memstep.serving.http_front.openai_protocol import OpenAIError

CLIENT_ERRORS = {"invalid_request", "invalid_field", "missing_field", "unknown_field"}
CLIENT_ERRORS |= {"constraint_unenforceable"}  # a schema the grammar engine cannot enforce
UNAVAILABLE = {"executor_dead", "executor_error", "recovering", "overloaded", "log_unwritable"}
UNAVAILABLE |= {ROUTE_LOST}
RETRY_AFTER_S = 1  # a refused request's Retry-After: a queue drains in about a TTFT budget
TOO_LARGE = {"frame_too_large"}


def as_server_error(exc: ServerError | TimeoutError | ConnectionError) -> ServerError:
    """A failure awaiting the core as the core's own kind of error: a lost link is ROUTE_LOST,
    a timeout core_timeout."""
    if isinstance(exc, ConnectionError):
        return ServerError(ROUTE_LOST, str(exc))
    return exc if isinstance(exc, ServerError) else ServerError("core_timeout", str(exc))


def error_of(exc: ServerError) -> OpenAIError:
    """The OpenAI error for an ErrorReply of the core: 400 for bad input, 503 when it cannot
    serve now, 500 otherwise."""
    if exc.code in CLIENT_ERRORS:
        return OpenAIError(400, exc.message, code=exc.code)
    if exc.code in TOO_LARGE:
        return OpenAIError(413, exc.message, code="request_too_large")
    if exc.code in UNAVAILABLE:
        return OpenAIError(503, exc.message, "service_unavailable", code=exc.code)
    if exc.code == "core_timeout":
        return OpenAIError(504, exc.message, "timeout", code=exc.code)
    return OpenAIError(500, exc.message, "internal_error", code=exc.code)


def error_response(exc: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error object; a 503 (the core cannot serve now) says when to retry."""
    headers = dict(headers or {})
    if exc.status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if exc.status in (408, 413):  # its body may be coming still: closed gracefully (lingering)
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), exc.status, headers=headers or None)
