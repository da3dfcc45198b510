"""The entry point groups add-ons fill, bundled ones (``pyproject.toml``) and others alike.

* ``celery_idem.stores`` (named in :mod:`celery_idem.stores`): a URL scheme -> a
  :class:`~celery_idem.stores.Store` class, ``"module:Class [pip extra]"``.
* ``celery_idem.receipts``: ``sqlalchemy`` or ``django`` -> the callable that opens the receipt
  of ``IdempotentTask.idempotent_transaction``.
* ``celery_idem.observers``: modules loaded with the app module, to register decision observers.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points

__all__ = ["OBSERVERS", "RECEIPTS", "registered"]

RECEIPTS = "celery_idem.receipts"
OBSERVERS = "celery_idem.observers"


@cache
def registered(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name (read once per process: the scan walks every
    installed distribution's metadata)."""
    return {point.name: point for point in entry_points(group=group)}
