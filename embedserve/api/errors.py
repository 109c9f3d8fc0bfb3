"""The one place where error kinds become HTTP statuses, in OpenAI's error envelope
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from index import errors as index_errors

from .. import errors

# (kind, status, OpenAI error type); the first match wins, so subclasses come first.
_STATUS: tuple[tuple[type[Exception], int, str], ...] = (
    (errors.AuthenticationError, 401, "authentication_error"),
    (errors.ValidationError, 400, "invalid_request_error"),
    (errors.NotFoundError, 404, "not_found_error"),
    (errors.MethodNotAllowedError, 405, "invalid_request_error"),
    (errors.PayloadTooLargeError, 413, "invalid_request_error"),
    (errors.OverloadedError, 429, "rate_limit_error"),
    (errors.UnavailableError, 503, "service_unavailable"),
    (index_errors.ValidationError, 400, "invalid_request_error"),
    (index_errors.NotFoundError, 404, "not_found_error"),
    (index_errors.ConflictError, 409, "conflict_error"),
    (index_errors.RetiredError, 503, "service_unavailable"),
    (index_errors.BackendBusyError, 429, "rate_limit_error"),
    (index_errors.BackendUnavailableError, 503, "service_unavailable"),
    (index_errors.StorageFullError, 507, "insufficient_storage"),
    (index_errors.IndexCorruptError, 500, "server_error"),
)


def status_for(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an error; anything unexpected is a 500."""
    for kind, status, error_type in _STATUS:
        if isinstance(exc, kind):
            return status, error_type
    return 500, "server_error"


def error_response(exc: BaseException) -> JSONResponse:
    """The error as a response: envelope, status, and `Retry-After` where retrying may work."""
    status, error_type = status_for(exc)
    known = isinstance(exc, index_errors.DescribedError)
    body = {"error": {"message": exc.message if known else "internal error; see the server log",
                      "type": error_type, "param": getattr(exc, "param", None) if known else None,
                      "code": getattr(exc, "code", None) if known else None}}
    headers = {"Retry-After": str(exc.retry_after)} if hasattr(exc, "retry_after") else {}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_error(exc: RequestValidationError) -> errors.ValidationError:
    """A schema violation as our ValidationError, naming the first offending field."""
    errs = exc.errors()
    if not errs:
        return errors.ValidationError("invalid request")
    extra = [".".join(str(p) for p in e["loc"] if p != "body") for e in errs if e.get("type") == "extra_forbidden"]
    if extra:
        names = ", ".join(f"`{n}`" for n in extra)
        verb = "is not a field" if len(extra) == 1 else "are not fields"
        return errors.ValidationError(f"{names} {verb} of this request (this server refuses what it does not "
                                      f"know rather than ignore it); remove {'it' if len(extra) == 1 else 'them'}",
                                      param=extra[0])
    e = errs[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    where = f"`{param}`: " if param else ""
    return errors.ValidationError(f"{where}{e.get('msg', 'invalid value')}", param=param)
