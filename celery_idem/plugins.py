"""The registries add-ons fill: stores by URL scheme, receipts by connection kind, observers.

Each is an entry point group, so a bundled add-on (``celery_idem.contrib``) and a third-party
package register the same way, in their ``pyproject.toml``::

    [project.entry-points."celery_idem.stores"]
    "myscheme" = "mypackage.store:MyStore [extra]"

* ``celery_idem.stores``: a URL scheme -> a :class:`~celery_idem.stores.Store` class; the
  extra in brackets is the pip extra named when its client library is missing.
* ``celery_idem.receipts``: ``sqlalchemy`` or ``django`` -> the callable that opens the
  receipt transaction of ``IdempotentTask.idempotent_transaction``.
* ``celery_idem.observers``: modules loaded when the app module is, to register decision
  observers (:func:`celery_idem.events.add_observer`) if their dependency is installed.

The core names none of them: it asks the group for a name.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points

__all__ = ["OBSERVERS", "RECEIPTS", "registered"]

# The stores' group is named in celery_idem.stores, the package it fills.
RECEIPTS = "celery_idem.receipts"
OBSERVERS = "celery_idem.observers"


@cache
def registered(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name (read once per process: the scan walks every
    installed distribution's metadata)."""
    return {point.name: point for point in entry_points(group=group)}
