"""One typed error hierarchy for everything a user can cause. Each kind says what went wrong;
the HTTP layer maps kinds to status codes in one place (`embedserve.api.errors.status_for`),
together with the index library's own errors (`index.errors`)."""

from __future__ import annotations

from index.errors import DescribedError


class EmbedServeError(DescribedError):
    """Base class of the service's errors (message, param and code as in `DescribedError`)."""


class ValidationError(EmbedServeError):
    """The request is malformed or asks for something impossible."""


class UnsupportedError(ValidationError):
    """A valid request this model cannot serve (no sparse head, no `dimensions`...)."""

    code = "unsupported"


class AuthenticationError(EmbedServeError):
    code = "invalid_api_key"


class NotFoundError(EmbedServeError):
    code = "model_not_found"


class MethodNotAllowedError(EmbedServeError):
    code = "method_not_allowed"


class PayloadTooLargeError(EmbedServeError):
    code = "payload_too_large"


class _RetryLater(EmbedServeError):
    """An error after which the same request may succeed; `retry_after` in whole seconds."""

    def __init__(self, message: str, *, retry_after: float, **kw):
        super().__init__(message, **kw)
        self.retry_after = max(1, int(round(retry_after)))


class OverloadedError(_RetryLater):
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw):
        super().__init__(message, retry_after=retry_after, **kw)


class RateLimitedError(OverloadedError):
    """One caller (API key, or client IP without keys) sent more than `--rate-limit` allows."""

    code = "rate_limited"


class UnavailableError(_RetryLater):
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0, **kw):
        super().__init__(message, retry_after=retry_after, **kw)


class ConfigError(Exception):
    """Settings that cannot work; raised at start-up with the reason and the flag to change."""
