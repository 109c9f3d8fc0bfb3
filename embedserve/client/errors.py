"""One exception type per error kind, each carrying the server's message, param and code."""

from __future__ import annotations


class EmbedServeClientError(Exception):
    """Base class of everything the client raises."""


class APIConnectionError(EmbedServeClientError):
    """The server could not be reached (or the connection broke) after every retry."""


class APITimeoutError(APIConnectionError):
    """The server did not answer within the timeout, after every retry."""


class APIStatusError(EmbedServeClientError):
    """The server answered with an error status; `message`, `param`, `code` are its own."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, retry_after: float | None = None):
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.retry_after = error_type, retry_after


class BadRequestError(APIStatusError):
    """400/413/422: change the request (never retried)."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key (never retried)."""


class NotFoundError(APIStatusError):
    """404: no such model, index or route."""


class ConflictError(APIStatusError):
    """409: the index belongs to another model (manifest mismatch), or the name is taken."""


class RateLimitError(APIStatusError):
    """429: the server is overloaded; retried with backoff, raised when retries run out."""


class ServiceUnavailableError(APIStatusError):
    """503: loading or shutting down; retried with backoff, raised when retries run out."""


class InternalServerError(APIStatusError):
    """5xx other than 503 (never retried: the same request would fail the same way)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 409: ConflictError,
              413: BadRequestError, 422: BadRequestError, 429: RateLimitError, 503: ServiceUnavailableError}


def error_from_response(status: int, body: bytes, headers) -> APIStatusError:
    """The typed error for an error response (OpenAI's envelope, or anything else)."""
    import json
    message, param, code, error_type = body.decode("utf-8", "replace")[:500] or f"HTTP {status}", None, None, None
    try:
        err = json.loads(body)["error"]
        message, param, code, error_type = err.get("message", message), err.get("param"), err.get("code"), err.get("type")
    except (ValueError, KeyError, TypeError):
        pass
    retry_after = None
    raw = headers.get("retry-after") if headers is not None else None
    if raw:
        try:
            retry_after = float(raw)
        except ValueError:
            pass
    kind = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return kind(status, message, param=param, code=code, error_type=error_type, retry_after=retry_after)
