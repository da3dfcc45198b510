"""Exactly-once effects for Celery tasks.

Public API: :class:`IdempotentTask`, :func:`idempotency_key` and the exceptions. This module
imports no store backend (neither ``redis`` nor ``sqlalchemy``).
"""

from __future__ import annotations

from .exceptions import (
    CorruptRecord,
    IdempotencyError,
    IdempotencyKeyMismatch,
    ImproperlyConfigured,
    LeaseLost,
    StoreUnavailable,
    TerminalError,
)
from .keys import idempotency_key
from .task import CachedResult, IdempotentTask

__version__ = "0.1.0"

__all__ = [
    "CachedResult",
    "CorruptRecord",
    "IdempotencyError",
    "IdempotencyKeyMismatch",
    "IdempotentTask",
    "ImproperlyConfigured",
    "LeaseLost",
    "StoreUnavailable",
    "TerminalError",
    "__version__",
    "idempotency_key",
]
