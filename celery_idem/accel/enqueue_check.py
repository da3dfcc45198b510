"""The enqueue check within the publish, chosen per task on a running share (an acceleration).

An acceleration (see :mod:`celery_idem.accel`); the plain path is
:func:`celery_idem.enqueue.check_enqueue` reading the record before publishing. The seam is
``IdempotentTask._enqueue_check``: an :class:`EnqueueCheck` per task with accelerations
on, None with them off. It decides, enqueue by enqueue, whether the record is read by the
script that pushes the message (:mod:`.redis_enqueue`) or first; both answer the same enqueues
the same way.

It also remembers, for a moment (:attr:`EnqueueCheck.RECENT`), the keys this process reserved
for the messages it published: a copy enqueued by the same process while its own message is in
flight attaches to it without a store round trip (:meth:`EnqueueCheck.mine`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import uuid4 as uuid

from celery.signals import before_task_publish
from kombu.exceptions import EncodeError

from ..records import Record, Reservation

try:  # the join guard Celery's own result handles use (celery/result.py)
    from celery._state import task_join_will_block
except ImportError:  # pragma: no cover - a Celery without it: the record is read first
    task_join_will_block = None  # type: ignore[assignment, unused-ignore]

if TYPE_CHECKING:
    from celery import Task
    from celery.result import AsyncResult

    from ..gate import Gate

__all__ = ["EnqueueCheck"]


#: celery_idem.accel.redis_enqueue, imported on first use (it needs kombu's Redis transport).
_fused: Any = None
_REDIS_STORE_MODULE = "celery_idem.stores.redis"

#: The Celery backends whose ``on_task_call`` leaves nothing to undo when a publish turns out
#: to be answered from the record (by name: importing them needs their client libraries).
_NOTHING_TO_UNDO = ("celery.backends.base", "celery.backends.rpc")


class EnqueueCheck:
    """How one task's enqueue check reads the record: before the publish, or within it.

    Read first, the check is a round trip of its own on every enqueue. With kombu's Redis
    transport on the same server and database as a plain Redis store, it can ride on the
    publish instead (:mod:`celery_idem.accel.redis_enqueue`): one round trip, and the check
    and the push are one atomic step. The price falls on an enqueue that *is* answered from
    the record: Celery has built and encoded its message by then (and subscribed to its result
    when the backend is Redis: undone here). So the check rides on the publish while few of
    this task's enqueues are answered (a running share, :attr:`THRESHOLD`), and reads first
    when many are (duplicates): both ways answer the same enqueues the same way.

    Not used (the record is read first) with accelerations off (there is none:
    ``IdempotentTask._enqueue_check``), in eager mode, with a ``before_task_publish`` receiver
    (it would hear of a message that is never sent), or with a result backend whose
    ``on_task_call`` does something this cannot undo.
    """

    #: The weight of each enqueue in the running share of enqueues answered from the record.
    WEIGHT = 1 / 16
    #: At or above this share the record is read first. An answered enqueue costs about five
    #: times more within the publish (the message built and encoded for nothing) than a read
    #: first costs every enqueue: break-even near 0.2 (docs/benchmarks.md).
    THRESHOLD = 0.2
    #: Seconds a message this process published under its reservation of a key answers a
    #: copy of that key from this process without asking the store (:meth:`mine`), while the
    #: caller still holds the message's result and has not seen it finish. The store would
    #: name the same message for at least its lease; the moment is kept short so that what can
    #: change that answer (an operator's ``forget``, a store that lost its data) is not hidden.
    RECENT = 1.0
    #: At most this many remembered keys (a larger burst starts the memory over).
    MAX_RECENT = 4096

    __slots__ = ("_backend", "_mine", "_undo", "answered", "possible")

    def __init__(self) -> None:
        self.answered = 0.0
        self.possible = True  # False once the broker turned out not to take the fused publish
        self._backend: Any = None
        self._undo: Callable[[str], None] | None = None
        self._mine: dict[str, tuple[Reservation, weakref.ref[AsyncResult], float]] = {}

    def remember(self, key: str, result: AsyncResult, fingerprint: str | None,
                 lease: float) -> None:
        """Note that this process published ``result`` under its reservation of ``key``."""
        mine = self._mine
        if len(mine) >= self.MAX_RECENT:
            mine.clear()  # each entry lives a moment: a burst this large only starts over
        mine[key] = (Reservation(result.id, fingerprint or None), weakref.ref(result),
                     time.monotonic() + min(self.RECENT, lease))

    def mine(self, key: str) -> Reservation | None:
        """The reservation of ``key`` for this process's own message still in flight, or None
        (ask the store).

        In flight: published less than :attr:`RECENT` ago, its result still held by the caller
        and not seen finished. A copy then shares that message as the store would have it
        share it, without the round trip; once the caller has seen the outcome (or let go of
        the result), a copy asks the store, and a done action is answered as ever (a
        :class:`~celery_idem.enqueue.CachedResult`).
        """
        found = self._mine.get(key)
        if found is None:
            return None
        reservation, ref, deadline = found
        result = ref()
        # AsyncResult._cache: its outcome, once this process has read it (get(), ready(), a
        # join); reading the state any other way would be the round trip saved here.
        if result is None or getattr(result, "_cache", None) or deadline <= time.monotonic():
            self._mine.pop(key, None)
            return None
        return reservation

    def _undo_for(self, backend: Any) -> Callable[[str], None] | None:
        if backend is not self._backend:  # the app's backend is built once (thread-local)
            self._backend, self._undo = backend, _undo_for(backend)
        return self._undo

    def saw(self, answered: bool) -> None:
        """Count one checked enqueue (answered from the record, or published)."""
        self.answered += ((1.0 if answered else 0.0) - self.answered) * self.WEIGHT

    def within_publish(self, task: Task, gate: Gate) -> bool:
        """Whether this enqueue tries the check within the publish."""
        if not self.possible or self.answered >= self.THRESHOLD:
            return False
        if _fused is None:
            # Only a Redis store can take it: never import the Redis side for another store
            # (an install without redis-py, the SQL extra alone, has none).
            if type(gate.store).__module__ != _REDIS_STORE_MODULE:
                self.possible = False
                return False
            from . import redis_enqueue

            globals()["_fused"] = redis_enqueue
        if type(gate.store) is not _fused.RedisStore:
            self.possible = False
            return False
        app = task.app
        if app.conf.task_always_eager or before_task_publish.receivers:
            return False
        return self._undo_for(app.backend) is not None

    def publish(
        self, task: Task, gate: Gate, key: str, header: str, producer: Any, task_id: str | None,
        send: Callable[[Any, str], AsyncResult], *, attach: bool = False,
        reserve: tuple[str, str, int] | None = None,
    ) -> AsyncResult | Record | Reservation | None:
        """Publish with the check within; what was found instead, if it answers the enqueue.

        Args:
            task: The task being enqueued.
            gate: Its gate (the store).
            key: The idempotency key.
            header: The message header that carries the key.
            producer: The caller's producer, or None (one is acquired from the app's pool).
            task_id: The task id the caller chose, or None (a new one).
            send: Publishes with the given producer and task id (``Task.apply_async``).
            attach: The enqueue may attach to an action under way: a record in progress is
                handed back too (nothing published).
            reserve: With ``attach``, reserve the key for the message pushed (``task_id``, the
                fingerprint or "", the lease in ms), or hand back another message's
                reservation (``celery_idem.attach``).

        Returns:
            The result of the publish; the record or the reservation found (nothing was
            published); or None when the broker cannot take the check (nothing was
            published: read first, then publish).

        Raises:
            kombu.exceptions.EncodeError: The message cannot be encoded; nothing was sent and
                the record was not read (the caller reads it: a done key is still answered).
        """
        fused = _fused
        assert fused is not None  # within_publish imported it
        store: Any = gate.store
        app = task.app
        with app.producer_or_acquire(producer) as prod:
            if not fused.fuse(prod.channel, store):
                self.possible = False
                return None
            sent_id = task_id or str(uuid())
            if reserve is not None:
                reserve = (sent_id, *reserve[1:])
            token = fused.begin(store, key, header, reserve if attach else None)
            try:
                result = send(prod, sent_id)
            except fused.ReservationFound as exc:
                undo = self._undo_for(app.backend)
                if undo is not None:
                    undo(sent_id)
                self.saw(True)
                return exc.reservation
            except (fused.RecordFound, EncodeError) as exc:
                # Not sent: the result subscription Celery made for it is not wanted.
                undo = self._undo_for(app.backend)
                if undo is not None:
                    undo(sent_id)
                if isinstance(exc, EncodeError):
                    raise
                self.saw(True)
                return exc.record
            finally:
                fused.end(token)
        self.saw(False)
        if reserve is not None and attach:
            self.remember(key, result, reserve[1], reserve[2] / 1000)
        return result


def _undo_for(backend: Any) -> Callable[[str], None] | None:
    """What undoes ``backend.on_task_call`` for a message that was not sent.

    None for an ``on_task_call`` this does not know: the check is then made before publishing.
    """
    on_task_call = getattr(type(backend), "on_task_call", None)
    if on_task_call is None or getattr(on_task_call, "__module__", "") in _NOTHING_TO_UNDO:
        return _nothing
    from celery.backends.redis import RedisBackend

    if on_task_call is RedisBackend.on_task_call and task_join_will_block is not None:
        consumer = backend.result_consumer

        def undo(task_id: str) -> None:
            # As on_task_call subscribed (not from within a worker's task: it would block).
            if not task_join_will_block():
                consumer.cancel_for(task_id)

        return undo
    return None


def _nothing(task_id: str) -> None:
    """Undo an ``on_task_call`` that did nothing (or only declared a reply queue)."""
