"""One typed error hierarchy for everything a user can cause; the HTTP layer maps it to
status codes in one place (`status_for`)."""

from __future__ import annotations


class EmbedServeError(Exception):
    """Base class: `message` says what to change, `param` names the offending field."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_envelope(self) -> dict:
        """OpenAI's error envelope."""
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


class ValidationError(EmbedServeError):
    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedError(ValidationError):
    """A valid request this model cannot serve (no sparse head, no `dimensions`...)."""

    code = "unsupported"


class AuthenticationError(EmbedServeError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFoundError(EmbedServeError):
    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


class ConflictError(EmbedServeError):
    """A write that would mix vectors of two models (manifest mismatch)."""

    status_code = 409
    error_type = "conflict_error"
    code = "manifest_mismatch"


class PayloadTooLargeError(EmbedServeError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class OverloadedError(EmbedServeError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw):
        super().__init__(message, **kw)
        self.retry_after = max(1, int(round(retry_after)))


class UnavailableError(EmbedServeError):
    status_code = 503
    error_type = "service_unavailable"
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0, **kw):
        super().__init__(message, **kw)
        self.retry_after = max(1, int(round(retry_after)))


class ConfigError(Exception):
    """Settings that cannot work; raised at start-up with the reason and the flag to change."""
