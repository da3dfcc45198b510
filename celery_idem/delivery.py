"""The worker side of the seam: one delivery through the gate, its re-queue, its result write."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from . import timelimits
from .app import emit_decision
from .config import settings
from .events import Outcome
from .exceptions import StoreUnavailable
from .gate import Attempt, Gate, Requeue, RunOutcome
from .probe import log_store_down, requeue_delay
from .results import ResultWriter

if TYPE_CHECKING:
    from celery import Task

logger = logging.getLogger("celery_idem")

__all__ = ["BUSY_FIRST", "BUSY_MAX", "OUTAGE_HEADER", "REQUEUES_HEADER", "deliver", "requeue"]

#: Message header counting re-queues of a duplicate that found the key busy (not retries).
REQUEUES_HEADER = "idempotency_requeues"
#: Message header counting re-queues because the store could not be used at claim time.
OUTAGE_HEADER = "idempotency_store_requeues"
#: A copy of a busy key goes back with a countdown of BUSY_FIRST x 2^n seconds, at most
#: BUSY_MAX, on its n-th re-queue, holding no pool process meanwhile (docs/scenarios.md).
BUSY_FIRST = 0.5
BUSY_MAX = 5.0


def deliver(task: Task, gate: Gate, writer: ResultWriter | None, attempt: Attempt,
            body: Callable[[int], Any], started: float) -> Any:
    """Run ``body`` (given the fencing token) through ``gate`` for ``task``'s current request,
    under its time limit (from ``started``, monotonic), and return the body's or the recorded
    result. A busy key or a store outage re-publishes the message (:func:`requeue`; past
    ``idempotency_store_requeues``, the caller is told); eager or direct calls wait or raise."""
    req = task.request
    local = req.is_eager or req.called_directly
    # No pool enforces a limit in the calling process (eager mode, a direct call).
    deadline = None if local else timelimits.request_deadline(task, req, started)
    fold = functools.partial(writer.build, req) if writer is not None and writer.folds else None
    n = int((req.headers or {}).get(REQUEUES_HEADER, 0))  # this message's re-queues so far
    rounds = 0
    while True:
        try:
            outcome = gate.run(attempt, body, fold, deadline=deadline)
        except Requeue as busy:
            if local:
                if isinstance(busy.__cause__, SoftTimeLimitExceeded):
                    # A direct call inside another task's body: that task's own limit.
                    raise busy.__cause__ from None
                # No broker to re-queue to: wait another round in place (backing off, since
                # with idempotency_wait=0 the gate does not wait itself).
                time.sleep(min(0.02 * 2 ** rounds, 0.5))
                rounds += 1
                continue
            # A freed key is claimed by the next delivery at once; a busy one is looked at
            # again later, later each time.
            countdown = 0.0 if busy.freed else min(BUSY_FIRST * 2.0 ** min(n, 16), BUSY_MAX)
            requeue(task, countdown=countdown, reason=str(busy))
        except StoreUnavailable as down:
            if local:
                raise
            outages = int((req.headers or {}).get(OUTAGE_HEADER, 0))
            limit = settings(task.app).store_requeues
            emit_decision(task, Outcome.REQUEUED, attempt.key, 0, req.id or "",
                          {"reason": "store_unavailable"})
            if limit is not None and outages == limit:
                # The caller is told, and the message is kept (it runs once the store answers).
                where = getattr(gate.store, "location", None) or repr(gate.store)  # no password
                told = StoreUnavailable(
                    f"the idempotency store ({where}) could not be used on {outages + 1} deliveries"
                    f" of this message ({outages} re-queues, idempotency_store_requeues = {limit}):"
                    f" {str(down).rstrip('.')}. The task did not run yet; its message stays queued"
                    f" and runs once the store answers")
                republish(task, requeue_delay(outages), OUTAGE_HEADER)
                with contextlib.suppress(Exception):  # a backend down too: the caller waits
                    task.backend.mark_as_failure(req.id, told, request=req, call_errbacks=False)
                logger.warning("celery_idem store unavailable: task %s[%s] key=%s failed for its caller"
                               " after %d re-queues; its message stays queued: %s", task.name,
                               req.id, attempt.key, outages, down)
                raise Ignore() from down
            log_store_down(task.name, req.id or "", attempt.key, down, outages, limit)
            requeue(task, countdown=requeue_delay(outages), reason=str(down), exc=down,
                    counter=OUTAGE_HEADER)
        else:
            if writer is not None:
                write_result(writer, req, outcome)
            return outcome.value


def write_result(writer: ResultWriter, req: Any, outcome: RunOutcome[Any]) -> None:
    """Store the result with ``writer`` (unless it rode on the record), or leave it to Celery."""
    if not outcome.folded:  # another server, a duplicate's answer, an ACL that refused the fold
        write = outcome.write or writer.build(req, outcome.value)
        if write is None or not writer.write(write):
            return
    # Stored: Celery must not write it again.
    req.ignore_result = True


def republish(task: Task, countdown: float, counter: str = REQUEUES_HEADER) -> Any:
    """Publish the current message again (same id and ``retries``, header ``counter`` + 1) and
    return its signature; ``Reject(requeue=True)`` when it cannot be published."""
    req = task.request
    headers = dict(req.headers or {})
    headers[counter] = int(headers.get(counter, 0)) + 1
    sig = task.signature_from_request(req, countdown=countdown, retries=req.retries,
                                      headers=headers)
    try:
        sig.apply_async()
    except Exception as publish_error:
        # Cannot publish: hand the message back to the broker instead of losing it.
        raise Reject(publish_error, requeue=True) from publish_error
    return sig


def requeue(task: Task, countdown: float, reason: str, exc: BaseException | None = None,
            counter: str = REQUEUES_HEADER) -> NoReturn:
    """:func:`republish`, then raise ``Retry`` (Celery acknowledges this delivery)."""
    sig = republish(task, countdown, counter)
    raise Retry(f"celery_idem re-queued: {reason}", exc=exc, when=countdown, sig=sig)
