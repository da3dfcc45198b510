"""Attach at enqueue: an enqueue whose key is in progress (a live claim) or reserved by a message
still queued (``Store.reserve``) publishes no copy that would only find the key busy: it returns
an :class:`AttachedResult` of the attempt it attached to."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from celery.backends.base import DisabledBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from celery.states import FAILURE, READY_STATES, REVOKED

from .app import emit_answer
from .events import Outcome
from .exceptions import IdempotencyKeyMismatch, StoreUnavailable
from .records import Record, Reservation, State
from .results import recorded_outcome

if TYPE_CHECKING:
    from celery import Task

    from .gate import Gate

__all__ = ["AttachedResult", "add_to_parent", "attach", "may_attach"]

logger = logging.getLogger("celery_idem")

#: Seconds of one wait on the result backend before the handle looks at the record (where an
#: outcome recorded under another task id shows).
FOLLOW_STEP = 1.0


def may_attach(task: Task, options: Mapping[str, Any]) -> bool:
    """Whether this enqueue may attach to an action under way instead of publishing: not eager,
    not with a countdown or an ETA (sooner than asked), not without a result backend."""
    return not (task.app.conf.task_always_eager or options.get("countdown") is not None
                or options.get("eta") is not None or isinstance(task.backend, DisabledBackend))


def attach(task: Task, gate: Gate, key: str, found: Record | Reservation, args: Sequence[Any] | None,
           kwargs: Mapping[str, Any] | None, options: Mapping[str, Any],
           fingerprint: Callable[[], str | None]) -> AttachedResult | None:
    """Attach this enqueue to the action ``found`` shows under way; None: publish instead.

    Raises:
        IdempotencyKeyMismatch: The action under way has another fingerprint (or none).
    """
    if isinstance(found, Record):
        if found.state is not State.IN_PROGRESS or not _live(found):
            return None  # not under way, or its holder is gone: this message takes over
        stored, holder, token, state = found.payload_hash, found.task_id, found.token, "in_progress"
    else:
        stored, holder, token, state = found.fingerprint, found.task_id, 0, "reserved"
    expected = fingerprint()
    if expected is not None and stored != expected:
        emit_answer(task, Outcome.MISMATCH, key, token, holder, holder, state)
        raise IdempotencyKeyMismatch(
            f"idempotency key {key!r} is in use by an action with different arguments (task "
            f"{holder}); use a new key for a new action. Nothing was sent.", key=key)
    emit_answer(task, Outcome.ATTACHED, key, token, holder, holder, state)
    result = AttachedResult(task, gate, key, holder, args, kwargs, options)
    add_to_parent(task, result, options)
    return result


def add_to_parent(task: Task, result: AsyncResult, options: Mapping[str, Any]) -> None:
    """List ``result`` among the running task's children, as ``apply_async`` does."""
    parent = task.app.current_worker_task
    if parent and options.get("add_to_parent", True):
        parent.add_trail(result)


def _live(rec: Record) -> bool:
    """Whether an in-progress record's lease still runs (a holder that can still record)."""
    return rec.lease_expires is None or rec.lease_expires > time.time()


class AttachedResult(AsyncResult):  # type: ignore[misc]
    """The result of an enqueue that attached to its action under way: nothing was published.

    An ``AsyncResult`` of the attempt it attached to, resolving to the holder's result in the
    backend, else to the outcome in the action's record (a takeover records it under the key).
    When the action has no attempt left for a whole lease, the handle publishes the call itself,
    once, under its id (under a new id when the holder ended without an outcome), and follows
    it. Revoking it revokes the shared action.

    Attributes:
        id: The task id of the attempt it attached to (the holder's, or the reserved message's).
        original_task_id: The same task id.
        idempotency_key: The key.
        attached: True (a published call's result has no such attribute).
        followed: The result of the call this handle published itself (None until then).
    """

    attached = True

    def __init__(self, task: Task, gate: Gate, key: str, task_id: str, args: Sequence[Any] | None,
                 kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]) -> None:
        super().__init__(task_id, app=task.app, task_name=task.name)
        self.idempotency_key = key
        self.original_task_id = task_id
        self.followed: AsyncResult | None = None
        self._task = task
        self._gate = gate
        self._call = (tuple(args or ()), dict(kwargs or {}), dict(options))
        self._gone_since: float | None = None
        self._found: tuple[str, Any] | None = None  # the Celery state and value recorded
        self._attached = time.time()  # a revoke stored before it is not this copy's

    @property
    def state(self) -> str:
        """The holder's state in the result backend; once the action's outcome is only in its
        record (a takeover under another task id), ``SUCCESS`` or ``FAILURE`` from there."""
        if self.followed is None:
            state = str(super().state)
            if state in READY_STATES and not self._attempt_ended():
                return state
            found = self._found or (None if self.followed else self._look())
            if found is not None or self.followed is None:
                return found[0] if found is not None else state
        return str(self.followed.state)

    status = state

    @property
    def result(self) -> Any:
        """The outcome's value (or error), as ``AsyncResult.result`` gives it."""
        if self.followed is not None:
            return self.followed.result
        return self._found[1] if self._found is not None else super().result

    info = result

    def get(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5,
            **kwargs: Any) -> Any:
        """Wait for the action's outcome: its value, or its error raised (``TimeoutError`` when
        not ready within ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.followed is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self.followed.get(timeout=left, propagate=propagate, interval=interval, **kwargs)
            if self._found is None:
                step = FOLLOW_STEP if deadline is None else \
                    max(0.0, min(FOLLOW_STEP, deadline - time.monotonic()))
                try:
                    out = super().get(timeout=step, propagate=propagate, interval=interval, **kwargs)
                except CeleryTimeoutError:
                    self._look()
                except Exception:
                    if not self._attempt_ended():
                        raise
                else:
                    if not self._attempt_ended():
                        return out
            if self._found is not None:
                state, value = self._found
                if state == FAILURE and propagate:
                    raise value
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError("The operation timed out.")

    wait = get

    def _look(self) -> tuple[str, Any] | None:
        """Read the record: its outcome if it has one; publish once the action has no attempt."""
        store, key = self._gate.store, self.idempotency_key
        try:
            rec = store.get(key)
            if rec is not None and rec.state in (State.DONE, State.FAILED):
                self._found = recorded_outcome(self._gate.codec, rec)
                return self._found
            live = (rec is not None and rec.state is State.IN_PROGRESS and _live(rec)) \
                or store.reservation(key) is not None
        except StoreUnavailable as exc:
            logger.debug("celery_idem attached result: store unreachable key=%s: %s", key, exc)
            return None
        if live:
            self._gone_since = None
        elif self._gone_since is None:
            self._gone_since = time.monotonic()
        elif time.monotonic() - self._gone_since >= self._gate.config.lease:
            # Its message is gone: send the call under that id (the gate still runs the body at
            # most once if the message turns up after all).
            self._publish(self.id, "has no attempt left")
        return None

    def _attempt_ended(self) -> bool:
        """Whether the holder ended without an outcome (FAILURE, or REVOKED before this copy
        attached, and none recorded): then follow the record's, or the call under a new id."""
        if self.followed is not None or self._found is not None:
            return True
        status = str(super().state)
        done = self.date_done if status == REVOKED else None
        if status != FAILURE and (done is None or done.timestamp() >= self._attached):
            return False
        if self._look() is None and self.followed is None:
            self._publish(str(uuid4()), f"ended as {status} with no outcome")
        return True

    def _publish(self, task_id: str, why: str) -> None:
        """Publish the call this handle stands for under ``task_id``, and follow it."""
        (args, kwargs, options), key = self._call, self.idempotency_key
        logger.warning("celery_idem attached result: the action of key=%s %s (task %s); "
                       "publishing the call again as task %s", key, why, self.id, task_id)
        headers = {**dict(options.get("headers") or {}), "idempotency_key": key}
        self.followed = self._task.apply_async(args, kwargs, task_id=task_id,
                                               **{**options, "headers": headers})
