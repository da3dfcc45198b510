"""The producer side of the seam: an enqueue answered from the record.

``apply_async`` builds one :class:`EnqueueRequest` and asks its task's strategy for a
:class:`Decision`: :class:`Publish` (the key reserved for the message) or :class:`Answer` (a
cached or attached result). :class:`ReadFirst` reads the record before publishing; its fast
twin within the Redis publish is :mod:`celery_idem.enqueue_redis`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from uuid import uuid4 as uuid

from celery import Celery
from celery.app import app_or_default
from celery.app.task import Context
from celery.result import AsyncResult, EagerResult
from celery.states import SUCCESS

from .app import emit_answer
from .attach import add_to_parent, attach, may_attach
from .compat import MetaHook, fire_full_barriers
from .events import Outcome
from .exceptions import IdempotencyKeyMismatch, StoreUnavailable
from .gate import Gate
from .records import Record, Reservation, State
from .results import ResultWriter, recorded_outcome, store_answer

if TYPE_CHECKING:
    from celery import Task

__all__ = ["Answer", "CachedResult", "Decision", "EnqueueRequest", "Publish", "ReadFirst",
           "answer_from_record", "answer_request", "restore_cached"]

logger = logging.getLogger("celery_idem")


class CachedResult(MetaHook, EagerResult):  # type: ignore[misc]
    """The result of an enqueue that found its key already recorded: nothing was published.

    ``get()`` returns the value (or raises the recorded error) at once; bound to the app's
    result backend, it works in a ``ResultSet`` or ``GroupResult``.

    Attributes:
        id: The task id the caller chose (``task_id=``, a frozen signature, a chain step, a
            chord body), under which the outcome was also stored; else the original task id,
            or a new id with the outcome stored under it when the body ran in a direct call.
        original_task_id: The task id of the attempt that ran the body ("" for a direct call).
        idempotency_key: The key.
    """

    def __init__(self, record: Record, value: Any, state: str, name: str | None = None, *,
                 task_id: str | None = None, app: Celery | None = None) -> None:
        super().__init__(task_id or record.task_id, value, state, name=name)
        self.idempotency_key = record.key
        self.original_task_id = record.task_id
        # EagerResult leaves both unset: a ResultSet holding it asks it for its backend.
        self.app = app
        self.backend = app.backend if app is not None else None
        self._waited_on = False
        self._waiters: list[Any] = []
        self._registering = False  # while then() registers this handle with the result consumer
        self._resolved_early = False

    def then(self, callback: Any, on_error: Any = None, weak: bool = False) -> Any:
        """Call ``callback`` now (the result is ready); a ResultSet's barrier it completes is
        fired when the result consumer hands this id's meta back during ``join_native``."""
        if self.backend is not None and self.backend.is_async:
            self._waited_on = True
            self._waiters.append(callback)
            self._registering = True
            try:
                self.backend.add_pending_result(self, weak=weak)
            finally:
                self._registering = False
            if self._resolved_early:
                # The consumer handed buffered meta over before the barrier was finalized:
                # register again, so the join's own fetch hands it over when it can fire.
                self._resolved_early = False
                self.backend.add_pending_result(self, weak=weak)
        return self.on_ready.then(callback, on_error)

    def on_meta(self, meta: Any) -> Any:
        if self._registering:
            self._resolved_early = True
            return meta
        fire_full_barriers(self._waiters)  # the consumer found this id's meta: the value is known
        self._waiters.clear()
        backend = self.backend
        if self._waited_on and backend is not None:
            self._waited_on = False
            backend.remove_pending_result(self)
        return meta

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The public result and state (EagerResult's _result and _state through its meta).
        return restore_cached, (self.id, self.result, self.state, self._name,
                                 self.idempotency_key, self.original_task_id)

    def __repr__(self) -> str:
        return f"<CachedResult: {self.id} (original {self.original_task_id})>"

    def __del__(self) -> None:
        # Cancel only a wait this handle registered (AsyncResult's __del__ always cancels).
        if getattr(self, "_waited_on", False):
            super().__del__()


def restore_cached(task_id: str, value: Any, state: str, name: str | None, key: str,
                   original_task_id: str) -> CachedResult:
    """Unpickle (or copy) a :class:`CachedResult`, bound to the current app."""
    rec = Record(key=key, state=State.DONE if state == SUCCESS else State.FAILED, token=0,
                 task_id=original_task_id)
    return CachedResult(rec, value, state, name, task_id=task_id, app=app_or_default())


def answer_from_record(task: Task, gate: Gate, writer: ResultWriter | None, key: str,
                       args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, task_id: str | None,
                       options: Mapping[str, Any], *, arguments_hash: Callable[[], str | None],
                       record: Record | None = None) -> CachedResult | None:
    """The answer from the record (read unless given) for an enqueue of a done (or failed) key,
    or None: publish. ``arguments_hash`` computes the call's fingerprint (None: it has none).

    Raises:
        IdempotencyKeyMismatch: The call's fingerprint differs from the record's (or it has none).
    """
    rec = record
    if rec is None:
        try:
            rec = gate.store.get(key)
        except StoreUnavailable as exc:  # the worker's gate still guards the body: publish
            logger.debug("celery_idem enqueue check skipped key=%s: %s", key, exc)
            return None
    if rec is None or rec.state not in (State.DONE, State.FAILED):
        return None
    expected = arguments_hash()
    if expected is not None and rec.payload_hash != expected:  # none: cannot show it is this action
        emit_answer(task, Outcome.MISMATCH, rec.key, rec.token, rec.task_id, task_id or rec.task_id,
                    rec.state.value)
        raise IdempotencyKeyMismatch(
            f"idempotency key {key!r} was first used with different arguments (task "
            f"{rec.task_id}); use a new key for a new action. Nothing was sent.", key=key)
    state, value = recorded_outcome(gate.codec, rec)
    conf = task.app.conf
    eager = conf.task_always_eager
    if not (task_id or rec.task_id):  # the body ran in a direct call: answer under a new id
        task_id = str(uuid())
    if task_id and task_id != rec.task_id and (not eager or conf.task_store_eager_result):
        # Someone may wait on this id (the caller, a chain, a parent): store the outcome under
        # it as Celery would; if that fails, publish, and the worker answers from the record.
        request = answer_request(task, task_id, args, kwargs, options)
        if not store_answer(task, writer, request, value, state):
            return None
    result = CachedResult(rec, value, state, name=task.name, task_id=task_id, app=task.app)
    emit_answer(task, Outcome.ANSWERED, rec.key, rec.token, rec.task_id, result.id,
                rec.state.value)
    if not eager:
        add_to_parent(task, result, options)
    return result


def answer_request(task: Task, task_id: str, args: Sequence[Any] | None,
                   kwargs: Mapping[str, Any] | None, options: Mapping[str, Any]) -> Context:
    """The request Celery's backend would store a result of ``task_id`` with."""
    parent = task.app.current_worker_task
    parent_id, root_id = options.get("parent_id"), options.get("root_id")
    if parent:  # as send_task fills them in
        parent_id = parent_id or parent.request.id
        root_id = root_id or parent.request.root_id or parent.request.id
    fields: dict[str, Any] = {
        "id": task_id, "task": task.name, "args": list(args or ()),
        "kwargs": dict(kwargs or {}), "called_directly": False, "is_eager": False,
        "parent_id": parent_id, "root_id": root_id, "group": options.get("group_id"),
        "group_index": options.get("group_index"),
        # The rpc:// backend replies to the caller's queue, as send_task's reply_to does.
        "reply_to": options.get("reply_to") or task.app.thread_oid,
        "correlation_id": task_id}
    ignore = options.get("ignore_result", task.ignore_result)
    if ignore is not None:  # unset: get_actual_ignore_result falls back to the task's
        fields["ignore_result"] = ignore
    return Context(fields)


class EnqueueRequest(NamedTuple):
    """One enqueue that the key's record may answer (not a retry, a re-queue or a canvas
    publish): the task, its gate and result writer (None: Celery writes), the key, the
    fingerprint (computed once; None: it has none), the ``apply_async`` call's arguments, and
    ``publish(producer, task_id, intent_within=False, **options_overridden)``, which sends the
    message (``intent_within``: the publish writes the task's intent itself)."""

    task: Task
    gate: Gate
    writer: ResultWriter | None
    key: str
    fingerprint: Callable[[], str | None]
    args: Sequence[Any] | None
    kwargs: Mapping[str, Any] | None
    task_id: str | None
    producer: Any
    options: Mapping[str, Any]
    publish: Callable[..., AsyncResult]


class Publish(NamedTuple):
    """The decision to publish the message, under ``task_id`` (None: a new id); ``reserved``:
    the key is reserved for that id (undone if the publish fails)."""

    task_id: str | None
    reserved: bool = False


class Answer(NamedTuple):
    """The decision that answers the enqueue with ``result``: a :class:`CachedResult`, an
    :class:`~celery_idem.attach.AttachedResult`, or the message the strategy published."""

    result: AsyncResult


Decision = Publish | Answer


class ReadFirst:
    """The enqueue check: read the record (or reserve the key), then decide (as the fast twin,
    :class:`celery_idem.enqueue_redis.WithinPublish`, does)."""

    def attaching(self, req: EnqueueRequest) -> bool:
        """Whether ``req`` may attach to an action under way (not with a chosen task id: that id
        is waited on)."""
        return req.task_id is None and may_attach(req.task, req.options)

    def decide(self, req: EnqueueRequest) -> Decision:
        """Publish ``req`` (with the key reserved when it may attach), or answer it."""
        store = req.gate.store
        attaching = self.attaching(req)
        reserving = attaching and store.reserves
        sent_id = str(uuid()) if reserving else req.task_id
        try:
            if sent_id is not None and reserving:
                found = store.reserve(req.key, sent_id, req.task.idempotency_config.lease,
                                      req.fingerprint())
            else:
                found = store.get(req.key)
        except StoreUnavailable as exc:  # publish under the id a lost reply's reservation names
            logger.debug("celery_idem enqueue check skipped key=%s: %s", req.key, exc)
            return Publish(sent_id, reserving)
        answer = self.answer(req, found, attaching) if found is not None else None
        if answer is not None:
            return Answer(answer)
        # Under the id reserved just now (found None), else any.
        return Publish(sent_id, True) if reserving and found is None else Publish(req.task_id)

    def answer(self, req: EnqueueRequest, found: Record | Reservation | None,
               attaching: bool) -> AsyncResult | None:
        """The answer what was found gives: a done or failed record's outcome, or the action
        under way to attach to; None: publish."""
        if isinstance(found, Record) and found.state in (State.DONE, State.FAILED):
            return answer_from_record(
                req.task, req.gate, req.writer, req.key, req.args, req.kwargs, req.task_id,
                req.options, arguments_hash=req.fingerprint, record=found)
        if attaching and found is not None:
            return attach(req.task, req.gate, req.key, found, req.args, req.kwargs,
                          req.options, req.fingerprint)
        return None

    def published(self, req: EnqueueRequest, decision: Publish, result: AsyncResult) -> None:
        """Told of the message published on ``decision`` (nothing to remember here)."""
