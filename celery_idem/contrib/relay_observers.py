"""Observers of the relay's passes (:mod:`celery_idem.contrib.relay`): each gets every pass's
``RelayReport``, the empty ones included (OpenTelemetry's relay metrics, for one).

Apart from the relay so that an observer registers without importing it: the observers load
with the core (``celery_idem.app``), before the relay can be imported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["RELAY_OBSERVERS", "add_relay_observer", "notify_relay_observers"]

logger = logging.getLogger("celery_idem")

#: The registered observers, in order.
RELAY_OBSERVERS: list[Callable[[Any], None]] = []


def add_relay_observer(observer: Callable[[Any], None]) -> None:
    """Register ``observer`` for every relay pass of this process (once; a repeat is ignored)."""
    if observer not in RELAY_OBSERVERS:
        RELAY_OBSERVERS.append(observer)


def notify_relay_observers(report: Any) -> None:
    """Pass one relay pass's report to every relay observer; an observer's error is logged,
    never raised (monitoring must not change what the relay did)."""
    for observer in RELAY_OBSERVERS:
        try:
            observer(report)
        except Exception as exc:
            logger.debug("celery_idem relay observer %r failed: %s", observer, exc)
