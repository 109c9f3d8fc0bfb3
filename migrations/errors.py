"""Errors a migration reports to its operator."""

from __future__ import annotations

from index.errors import DescribedError


class MigrationError(DescribedError):
    """A migration cannot start or go on (already running, nothing to roll back to, ...)."""


class GateFailed(MigrationError):
    """The verification gate refused the new version; the live version was not touched."""

    def __init__(self, message: str, report):
        super().__init__(message, code="gate_failed")
        self.report = report
