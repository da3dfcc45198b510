"""Exactly-once effects for Celery tasks.

Public API: :class:`IdempotentTask`, :func:`idempotency_key` and the exceptions. This module
imports no store backend, and no Celery until :class:`IdempotentTask` or :class:`CachedResult`
is first used (they load ``celery_idem.task``): ``import celery_idem.gate`` stays Celery-free.
"""

from __future__ import annotations

import typing as _typing

from .exceptions import (
    CorruptRecord,
    IdempotencyError,
    IdempotencyKeyMismatch,
    ImproperlyConfigured,
    InvalidKey,
    LeaseLost,
    StoreUnavailable,
    TerminalError,
)
from .keys import idempotency_key
from .version import __version__

if _typing.TYPE_CHECKING:
    from .task import CachedResult, IdempotentTask

__all__ = ["CachedResult", "CorruptRecord", "IdempotencyError", "IdempotencyKeyMismatch",
           "IdempotentTask", "ImproperlyConfigured", "InvalidKey", "LeaseLost",
           "StoreUnavailable", "TerminalError", "__version__", "idempotency_key"]


def __getattr__(name: str) -> _typing.Any:
    if name in ("CachedResult", "IdempotentTask"):  # the Celery seam, loaded on first access
        from . import task

        globals().update(CachedResult=task.CachedResult, IdempotentTask=task.IdempotentTask)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
