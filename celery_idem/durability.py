"""The worker-start durability check: can the store lose records (a Redis without AOF on a
restart, an evicting ``maxmemory-policy`` under memory pressure)? One WARNING, or with
``idempotency_require_durable_store = True`` a refusal to start."""

from __future__ import annotations

import logging

from .exceptions import ImproperlyConfigured, StoreUnavailable
from .stores.base import Store

__all__ = ["REQUIRE_DURABLE_SETTING", "check_replication", "check_store"]

logger = logging.getLogger("celery_idem")

#: The app setting that turns the warning into a refusal to start.
REQUIRE_DURABLE_SETTING = "idempotency_require_durable_store"


def check_store(store: Store, *, require: bool = False) -> None:
    """Log what ``store.check_durability()`` finds; refuse to start on a risk if ``require``
    (``ImproperlyConfigured`` naming the settings)."""
    try:
        findings = store.check_durability()
    except StoreUnavailable as exc:  # only advice: the gate handles an unreachable store
        logger.warning("celery_idem could not check the store's durability at worker start: %s", exc)
        return
    notes = [f for f in findings if f.level < logging.WARNING]
    risks = [f for f in findings if f.level >= logging.WARNING]
    if notes:
        logger.info("celery_idem store durability not checked: %s", "; ".join(f.risk for f in notes))
    if not risks:
        return
    settings = ", ".join(f"{f.setting} {f.value}" for f in risks)
    detail = "; ".join(f.risk for f in risks)
    advice = "; ".join(dict.fromkeys(f.fix for f in risks))
    if require:
        raise ImproperlyConfigured(
            f"{REQUIRE_DURABLE_SETTING} is set and the idempotency store can lose records "
            f"({settings}): {detail}. Fix: {advice}, or unset {REQUIRE_DURABLE_SETTING}")
    logger.warning(
        "celery_idem the idempotency store can lose records (%s), and then run actions twice: "
        "%s. Fix: %s; set %s = True to refuse to start on such a store",
        settings, detail, advice, REQUIRE_DURABLE_SETTING)


def check_replication(store: Store) -> None:
    """Warn when a store that waits for replicas (``wait_replicas``) has too few connected:
    every write fails, and the gate re-queues every task until one connects."""
    try:
        found = store.replication_warnings()
    except StoreUnavailable as exc:
        logger.warning("celery_idem could not check the store's replicas at worker start: %s", exc)
        return
    for line in found:
        logger.warning("celery_idem %s", line)
