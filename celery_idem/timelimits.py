"""Celery time limits and the wait of a duplicate (the task seam's side; the gate gets a deadline).

A limit firing while a duplicate waits for a busy key ends the request as FAILURE and acks its
message, so the wait is bounded by what is left of the limit that fires first, less a margin for
the re-queue. A limit comes from, first match wins (as in Celery's ``Request.execute_using_pool``):
the call (``request.timelimit``), the task's options (filled from the app's ``task_*time_limit``),
the worker's ``--soft-time-limit``/``--time-limit``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .exceptions import ImproperlyConfigured

__all__ = ["MARGIN_MAX", "MARGIN_MIN", "MIN_TIME_LIMIT", "Limits", "check_definition",
           "check_worker", "margin", "request_deadline", "set_worker_limits"]

logger = logging.getLogger("celery_idem")

#: The margin kept before a limit: a share of it, within [``MARGIN_MIN``, ``MARGIN_MAX``] s.
MARGIN_SHARE = 0.2
MARGIN_MIN = 0.5
MARGIN_MAX = 5.0
#: A shorter limit leaves a duplicate less than ``MARGIN_MIN`` s to wait for a busy key.
MIN_TIME_LIMIT = 2 * MARGIN_MIN

#: Schemes of the kombu transports with a ``visibility_timeout``.
_VISIBILITY_SCHEMES = frozenset({"redis", "rediss", "sentinel"})
_DEFAULT_VISIBILITY = 3600.0

#: The worker's ``--soft-time-limit``/``--time-limit`` (set at ``worker_init``, before the fork).
_worker: dict[str, float | None] = {"soft": None, "hard": None}


def margin(limit: float) -> float:
    """Seconds a waiting duplicate keeps free before ``limit`` fires, to re-queue itself."""
    return min(max(limit * MARGIN_SHARE, MARGIN_MIN), MARGIN_MAX)


def set_worker_limits(soft: float | None, hard: float | None) -> None:
    """Record the worker's own time limits (the pool applies them when nothing else does)."""
    _worker["soft"], _worker["hard"] = soft or None, hard or None


def request_deadline(task: Any, request: Any, started: float) -> float | None:
    """The ``monotonic()`` time by which a duplicate must stop waiting, or None (no limit);
    ``started``: when ``__call__`` started (the margin covers Celery's earlier start)."""
    # The precedence of ``_limits`` (see why there), unnamed: this runs on every call.
    hard, soft = getattr(request, "timelimit", None) or (None, None)
    conf = task.app.conf
    soft = soft or task.soft_time_limit or _worker["soft"] or conf.get("task_soft_time_limit")
    hard = hard or task.time_limit or _worker["hard"] or conf.get("task_time_limit")
    if not (soft or hard):
        return None
    first = min(limit for limit in (soft, hard) if limit)  # the one that fires first
    return started + first - margin(first)


@dataclass(frozen=True)
class Limits:
    """A task's effective time limits outside any call, with the setting each came from."""

    soft: float | None
    hard: float | None
    soft_from: str
    hard_from: str

    @property
    def first(self) -> tuple[float, str] | None:
        """The limit that fires first and the setting that set it (None: no limit)."""
        found = [(v, n) for v, n in ((self.soft, self.soft_from), (self.hard, self.hard_from)) if v]
        return min(found) if found else None

    @property
    def longest(self) -> tuple[float, str] | None:
        """How long a body can run at most: the hard limit, else the soft one."""
        if self.hard:
            return self.hard, self.hard_from
        return (self.soft, self.soft_from) if self.soft else None


def _limits(task: Any, conf: Any) -> Limits:
    """``task``'s limits as a worker applies them, naming the setting of each (``conf`` None:
    the task's own options only, for a class being defined)."""
    worker = _worker if conf is not None else {"soft": None, "hard": None}

    def one(option: str, setting: str, flag: str, fallback: float | None) -> tuple[float | None, str]:
        own = getattr(task, option, None)
        setting_value = conf.get(setting) if conf is not None else None
        # Celery copies the app setting onto a task that sets no option of its own (5.7), or
        # leaves it to the pool (older), where the worker's flag wins over it: name the source.
        value = own or fallback or setting_value
        if not value:
            return None, ""
        if value == setting_value:
            return value, f"{setting}={value:g} (app setting)"
        if value == own:
            return value, f"{option}={value:g} (task option)"
        return value, f"{flag}={value:g} (worker)"

    soft, soft_from = one("soft_time_limit", "task_soft_time_limit", "--soft-time-limit", worker["soft"])
    hard, hard_from = one("time_limit", "task_time_limit", "--time-limit", worker["hard"])
    return Limits(soft, hard, soft_from, hard_from)


def check_definition(label: str, task_class: Any) -> None:
    """Refuse, with ``ImproperlyConfigured``, task-option limits that leave a duplicate no time
    to wait, when a task class is created."""
    _refuse(label, _limits(task_class, None))


def _refuse(label: str, limits: Limits) -> None:
    first = limits.first
    if first is None:
        return
    limit, source = first
    if limit < MIN_TIME_LIMIT:
        raise ImproperlyConfigured(
            f"{label}: {source} leaves a duplicate no time to wait for a busy key: the wait ends "
            f"{margin(limit):g} s before the limit, to re-queue the message before the limit "
            f"can fail it. Use a limit of at least {MIN_TIME_LIMIT:g} s for an IdempotentTask.")


def check_worker(app: Any, tasks: Iterable[Any], time_limit: float | None,
                 soft_time_limit: float | None) -> None:
    """At worker start: refuse limits that cannot work (``ImproperlyConfigured``), warn once
    about those that degrade."""
    set_worker_limits(soft_time_limit, time_limit)
    conf = app.conf
    visibility = _visibility_timeout(conf)
    short_wait: list[str] = []
    redelivered: list[str] = []
    for task in tasks:
        limits = _limits(task, conf)
        cfg = task.idempotency_config
        _refuse(task.name, limits)
        first = limits.first
        if first is not None:
            budget = first[0] - margin(first[0])
            if cfg.wait > budget:
                short_wait.append(
                    f"{task.name} (idempotency_wait={cfg.wait:g}, {first[1]}: waits at most "
                    f"{budget:g} s)")
        longest = limits.longest
        if visibility is not None and longest is not None and longest[0] >= visibility:
            redelivered.append(f"{task.name} ({longest[1]})")
    if short_wait:
        logger.warning(
            "celery_idem: idempotency_wait is longer than the time limit allows for %s. A "
            "duplicate of a busy key re-queues itself sooner, before its own limit can fail "
            "it; that costs a broker round trip per re-queue, nothing else.",
            "; ".join(short_wait))
    if redelivered:
        logger.warning(
            "celery_idem: the broker's visibility_timeout (%g s) is not longer than the time "
            "limit of %s. A task still running when it runs out is delivered again beside the "
            "original; the copy waits and re-queues (harmless, but it costs worker slots). Set "
            "broker_transport_options['visibility_timeout'] above the longest time limit.",
            visibility, ", ".join(redelivered))


def _visibility_timeout(conf: Any) -> float | None:
    """The broker's ``visibility_timeout``, or None when the transport has none."""
    url = conf.broker_url or ""
    first = url.split(";")[0] if isinstance(url, str) else ""
    scheme = urlsplit(first).scheme.split("+")[0]
    if scheme not in _VISIBILITY_SCHEMES:
        return None
    options = conf.broker_transport_options or {}
    return float(options.get("visibility_timeout") or _DEFAULT_VISIBILITY)
