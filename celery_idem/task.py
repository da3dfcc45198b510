"""``IdempotentTask``: the Celery seam. Thin on purpose: the decisions live in ``gate.py``.

``apply_async`` (every publish, retries and canvas too) puts the key in the ``idempotency_key``
header, or answers without publishing when the key is done; ``__call__`` (every pool, eager
mode) reads the key from it (or derives it) and runs the body through the gate. The rest of the
seam: ``app.py``, ``identity.py``, ``enqueue.py``, ``delivery.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.result import AsyncResult
from kombu.exceptions import EncodeError

from . import identity, intents, timelimits
from .app import emit_decision, get_store, owner_id
from .codec import KombuCodec
from .compat import push_fresh_request
from .config import DEFAULT_TERMINAL_ON, IdempotencyConfig, check_options, resolve, settings
from .delivery import OUTAGE_HEADER, REQUEUES_HEADER, deliver
from .enqueue import Answer, CachedResult, EnqueueRequest, Publish, ReadFirst
from .exceptions import ImproperlyConfigured
from .gate import Attempt, Gate
from .identity import BEAT_HEADER, HEADER, PRINCIPAL_HEADER, failed_request, message_time
from .keys import bind_arguments, signature_of
from .lease import current_lease
from .paths import enqueue_check, result_writer
from .plugins import RECEIPTS, registered
from .results import ResultWriter

__all__ = ["HEADER", "CachedResult", "IdempotentTask", "get_store"]

logger = logging.getLogger("celery_idem")


class ReceiptFound(BaseException):
    """Raised out of ``idempotent_transaction`` when an earlier attempt committed the receipt
    (a BaseException, so a body's ``except Exception`` cannot swallow it)."""

    def __init__(self, receipt: Any) -> None:
        super().__init__(f"receipt found: {receipt!r}")
        self.receipt = receipt


class Replaced(Ignore):  # type: ignore[misc]
    """Celery's ``Ignore`` as :meth:`IdempotentTask.on_replace` raises it: the gate sees a
    hand-over (``handover_signals``) and releases the claim without recording."""


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery task whose body runs at most once per business action.

    Subclass it, or pass ``base=IdempotentTask`` to ``@app.task``. Each ``idempotency_*``
    option below is a class attribute or an ``@app.task`` keyword (unknown names are rejected
    when the class is created); docs/configuration.md says the rest of each.
    """

    #: Names of the arguments that identify the business action (None: all arguments).
    idempotency_fields: ClassVar[Sequence[str] | None] = None
    #: ``callable(*args, **kwargs) -> str``: the action's identity, used instead of the fields.
    idempotency_key_func: ClassVar[Any] = None
    #: Operation part of the key (default: the task name).
    idempotency_operation: ClassVar[str | None] = None
    #: Seconds a done or failed record lives; after that the action may run again.
    idempotency_ttl: ClassVar[float] = 86400
    #: Seconds a claim lives without a heartbeat (renewed every third of it while the body runs).
    idempotency_lease: ClassVar[float] = 60
    #: Exceptions that release the claim so a retry can run the body again.
    idempotency_release_on: ClassVar[Any] = None
    #: Exceptions recorded as the action's outcome; duplicates re-raise them without running.
    idempotency_terminal_on: ClassVar[Any] = DEFAULT_TERMINAL_ON
    #: Store a hash of the full arguments and refuse the key with other arguments.
    idempotency_validate: ClassVar[bool] = False
    #: A per-call key's record keeps a hash of the arguments that identify the action.
    idempotency_fingerprint: ClassVar[bool] = True
    #: Seconds a delivered duplicate holds its pool process waiting for a key in progress.
    idempotency_wait: ClassVar[float] = 0
    #: Seconds the gate keeps retrying the record of a finished body while the store is down.
    idempotency_record_timeout: ClassVar[float] = 10
    #: Read the record at enqueue, so an enqueue of a done key publishes nothing.
    idempotency_check_on_enqueue: ClassVar[bool] = True
    #: Seconds of a schedule slot (None: no slot).
    idempotency_period: ClassVar[float | None] = None
    #: Keep the encoded message in the store until the outcome is recorded; the relay re-sends it
    #: if the broker loses it (docs/reliability.md, "Lost messages").
    idempotency_intent: ClassVar[bool] = False

    #: At-least-once delivery (acknowledged after the body, re-delivered if the worker dies):
    #: the gate makes the repeats harmless.
    acks_late = True
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        label = str(vars(cls).get("name") or cls.__qualname__)
        check_options(label, vars(cls))
        # Check the values now too, so a wrong option fails at definition, not at first call.
        terminal = resolve(label, cls, signature_of(vars(cls).get("run"))).terminal_on
        # A recorded terminal outcome is expected: Celery logs ``throws`` at INFO, no traceback.
        cls.throws = (*cls.throws, *(t for t in terminal if t not in cls.throws))
        timelimits.check_definition(label, cls)

    # -- configuration -------------------------------------------------------------------------

    @cached_property
    def idempotency_config(self) -> IdempotencyConfig:
        """The task's options, checked and frozen (once per task instance)."""
        return resolve(self.name, self, self._signature)

    @cached_property
    def _signature(self) -> inspect.Signature | None:
        return signature_of(self.run)

    @cached_property
    def _call_signature(self) -> inspect.Signature | None:
        # Not followed through functools.wraps: a decorator taking *args, **kwargs binds any call.
        try:
            return inspect.signature(self.run, follow_wrapped=False)
        except (TypeError, ValueError):
            return None

    @cached_property
    def _enqueue_check(self) -> ReadFirst:
        return enqueue_check(self, self._gate.store)

    @cached_property
    def _result_writer(self) -> ResultWriter | None:
        return result_writer(self, self._gate.store)

    @property
    def idempotency_gate(self) -> Gate:
        """The task's gate: its store (``.store``), options (``.config``), codec and ``run``
        (for add-ons such as ``celery_idem.contrib.saga``)."""
        return self._gate

    @cached_property
    def _gate(self) -> Gate:
        app = self.app
        accept = app.conf.result_accept_content or app.conf.accept_content
        return Gate(
            get_store(app), self.idempotency_config,
            # Through the backend's prepare_value, as Celery stores results: an AsyncResult a
            # body returns is recorded as its as_tuple(), not refused by the serializer.
            KombuCodec(app.conf.result_serializer, accept,
                       prepare=lambda value: self.backend.prepare_value(value)),
            emit=functools.partial(emit_decision, self),
            retry_signals=(Retry, Reject),  # it re-published itself, or asked for redelivery
            handover_signals=(Replaced,),  # Task.replace: the replacement carries the action
            interrupts=(SoftTimeLimitExceeded,),  # its own soft limit, while waiting: re-queue
        )

    # -- the key -------------------------------------------------------------------------------

    def idempotency_key_for(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, *,
        idempotency_key: str | None = None, idempotency_scope: str | None = None,
        at: float | dt.datetime | None = None, scheduled: bool = False,
    ) -> str:
        """Return the key a call with these arguments gets (as stored, without the prefix).

        Its forms: docs/concepts.md, "Key"; the arguments are keyed as Celery sends them
        (docs/compat.md).

        Args:
            args: The call's positional arguments.
            kwargs: The call's keyword arguments.
            idempotency_key: A per-call key, as passed to ``apply_async``.
            idempotency_scope: A scope, as passed to ``apply_async`` (default: inside a scoped
                body, the body's).
            at: With ``idempotency_period``, the enqueue time whose slot a derived key gets (Unix
                seconds or an aware datetime; default: now).
            scheduled: The key of a send of the schedule (Celery beat's): the slot nearest to
                ``at``, rather than the current one.

        Raises:
            TypeError: The arguments do not match the task's signature (and the task checks
                them: ``typing``), or a value that is part of the key has no canonical form.
            InvalidKey: The per-call key or the scope is not usable.
            ValueError: ``at`` is a naive datetime.
        """
        scope = self._call_scope(idempotency_scope, {})  # inside a body, as apply_async has it
        return identity.identify(self, args, kwargs, idempotency_key, scope, at, scheduled).key

    @property
    def idempotency_key(self) -> str | None:
        """The key of the business action being run (inside the body), else None."""
        return getattr(self.request, "idempotency_key_", None)

    @property
    def idempotency_scope(self) -> str | None:
        """The scope of the business action being run (inside the body), else None."""
        return getattr(self.request, "idempotency_scope_", None)

    @property
    def idempotency_principal(self) -> str | None:
        """Who asked for the action being run (inside the body), else None: the message's
        ``idempotency_principal`` header, as trustworthy as whoever can publish to the broker."""
        value = (self.request.headers or {}).get(PRINCIPAL_HEADER)
        return value if type(value) is str and value.isprintable() else None

    @property
    def idempotency_token(self) -> int | None:
        """The fencing token of this attempt's claim (inside the body), else None: strictly
        increasing per key across claims and takeovers, for a remote that rejects lower ones."""
        return getattr(self.request, "idempotency_token_", None)

    @property
    def idempotency_lease_lost(self) -> bool:
        """True once a renewal found that another attempt took this claim over (inside the body):
        check it before a write that cannot be taken back (recording it would be refused, but
        the effect would have happened)."""
        lease = current_lease.get()
        return lease is not None and lease.lost.is_set()

    def idempotent_transaction(
        self, session_or_connection: Any = None, *, commit: bool = True, table: str | None = None,
        using: str | None = None,
    ) -> Any:
        """Write this action's receipt in the same SQL transaction as the body's own writes.

        Inside a bound body, ``with self.idempotent_transaction(session) as tx:`` (set
        ``tx.result``); if an earlier attempt committed the receipt, the block does not run and
        the task returns that attempt's ``tx.result``. See ``docs/transactions.md``.

        Args:
            session_or_connection: A SQLAlchemy ``Session`` or ``Connection`` to the business
                database; None on Django (the block is ``transaction.atomic(using=using)``).
            commit: False: the receipt joins a transaction the caller commits.
            table: The receipts table (default ``idempotency_receipts_table``, else ``celery_idem_receipts``).
            using: On Django, the ``DATABASES`` alias of the writes (default ``"default"``).

        Raises:
            RuntimeError: Called outside a running body, inside a saga step, or again in one
                run after a block that was not rolled back by ``idempotent_transaction`` itself.
            TypeError: Not a Session or Connection, or an unsupported database.
            ValueError: The prefixed key is longer than the receipt's 255-character column.
            LeaseLost: On exit, when another attempt took the claim over (rolled back).
        """
        req = self.request
        key, token = self.idempotency_key, self.idempotency_token
        if key is None or token is None:
            raise RuntimeError(
                f"{self.name}: idempotent_transaction must be used inside the running body of "
                f"an IdempotentTask (bind=True, called through the worker, delay() or apply())")
        held = current_lease.get()
        if held is not None and held.key != key:
            # A saga step's key: a receipt keyed by the task would answer the saga with the step's.
            raise RuntimeError(
                f"{self.name}: idempotent_transaction cannot be used inside a saga step (the "
                f"step runs under its own key {held.key!r}); write the step's receipt-worthy "
                f"effect in the task body, or make the step its own IdempotentTask")
        earlier = getattr(req, "idempotency_receipt_", None)
        if earlier is not None and not earlier.rolled_back:
            # Only a block it rolled back (a retry after a deadlock) surely left no receipt.
            raise RuntimeError(
                f"{self.name}: idempotent_transaction was already used in this run of "
                f"{key!r}; one action has one receipt, so put all its writes in one block")
        read = settings(self.app)
        # The receipts are add-ons (Django's connection, or a SQLAlchemy one), found by kind.
        kind = "django" if session_or_connection is None else "sqlalchemy"
        point = registered(RECEIPTS).get(kind)
        if point is None:
            raise ImproperlyConfigured(
                f"{self.name}: no {kind} receipts are installed (the {RECEIPTS!r} entry point "
                f"group has none): pip install 'celery-idem[{'django' if kind == 'django' else 'sql'}]'")
        tx = point.load()(
            session_or_connection, commit=commit, using=using or "default",
            table=table or read.receipts_table or "celery_idem_receipts",
            key=read.key_prefix + key, token=token, task_id=req.id or "", codec=self._gate.codec,
            ttl=self.idempotency_config.ttl, lease_lost=lambda: self.idempotency_lease_lost,
            on_found=ReceiptFound)
        req.idempotency_receipt_ = tx
        return tx

    # -- producer side -------------------------------------------------------------------------

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None, producer: Any = None, link: Any = None, link_error: Any = None,
        shadow: str | None = None, **options: Any,
    ) -> AsyncResult:
        """Publish the task with its key in the ``idempotency_key`` header.

        Takes every option of :meth:`celery.Task.apply_async`, plus ``idempotency_key`` (a
        per-call key used verbatim). When the key is already done (or failed terminally), no
        message is published and a :class:`CachedResult` is returned at once (unless
        ``idempotency_check_on_enqueue = False``), under the chosen task id if any (the outcome
        is stored under it too), else the original's. The result carries ``.idempotency_key``.

        Raises:
            TypeError: The key cannot be derived from the arguments; nothing was published.
            InvalidKey: The per-call key or the scope is not usable.
        """
        explicit = options.pop(HEADER, None)
        headers = dict(options.pop("headers", None) or {})
        scope = self._call_scope(options.pop("idempotency_scope", None), headers)
        # A key carried already (a retry, a re-queue, a canvas step) is one of this task and scope.
        call = identity.identify(self, args, kwargs, explicit, scope,
                                 scheduled=identity.scheduled_send(headers),
                                 header=headers.get(HEADER) if explicit is None else None)
        headers[HEADER] = key = call.key
        # A publish by the task itself (retry, re-queue) or one carrying a canvas must go out (an
        # answer would strand it); a chain's last step and a link callback are answered.
        republish = bool(options.get("retries")) or REQUEUES_HEADER in headers \
            or OUTAGE_HEADER in headers
        canvas = link or link_error or options.get("chain") or options.get("chord") \
            or options.get("group_id")

        def publish(prod: Any, sent_id: str | None, intent_within: bool = False,
                    **extra: Any) -> AsyncResult:
            # intent_within: the publish writes the intent itself (the check within the Redis
            # publish, celery_idem.enqueue_redis), else the producer wrapped here does.
            send = functools.partial(
                super(IdempotentTask, self).apply_async, args, kwargs, task_id=sent_id,
                link=link, link_error=link_error, shadow=shadow, headers=headers,
                **({**options, **extra} if extra else options))
            if intent_within or not self.idempotency_config.intent:
                return send(producer=prod)
            if prod is not None:  # the store keeps the message (an eager call sends none)
                return send(producer=intents.IntentProducer(prod, self))
            if self.app.conf.task_always_eager:
                return send(producer=None)  # no producer acquired: there may be no broker
            with self.app.producer_or_acquire() as real:
                return send(producer=intents.IntentProducer(real, self))

        decision: Publish | Answer = Publish(task_id)
        request: EnqueueRequest | None = None
        if not republish and not canvas and self.idempotency_config.check_on_enqueue:
            request = EnqueueRequest(
                task=self, gate=self._gate, writer=self._result_writer, key=key,
                fingerprint=call.fingerprint, args=args, kwargs=kwargs, task_id=task_id,
                producer=producer, options=options, publish=publish)
            decision = self._enqueue_check.decide(request)
        if isinstance(decision, Answer):
            decision.result.idempotency_key = key
            return decision.result
        try:
            result = publish(producer, decision.task_id)
        except BaseException as exc:
            if decision.reserved and decision.task_id:
                # Not sent: later enqueues must not attach to a message that does not exist.
                with contextlib.suppress(Exception):
                    self._gate.store.unreserve(key, decision.task_id)
            if isinstance(exc, EncodeError):
                serializer = (options.get("serializer") or self.serializer
                              or self.app.conf.task_serializer)
                raise call.unsendable(serializer, exc) from exc
            raise
        if request is not None:
            self._enqueue_check.published(request, decision, result)
        result.idempotency_key = key
        return result

    def _call_scope(self, scope: str | None, headers: dict[str, Any]) -> str | None:
        """The scope a call names, else that of the body enqueueing it (a chain's next step, a
        tool's, a saga's), whose principal rides along: two tenants never share a child's key."""
        parent = self.app.current_task if identity.SCOPED_BODY.get() else None
        if parent is None or parent.request is None:
            return scope
        req = parent.request
        if PRINCIPAL_HEADER in (req.headers or {}):
            headers.setdefault(PRINCIPAL_HEADER, req.headers[PRINCIPAL_HEADER])
        return getattr(req, "idempotency_scope_", None) if scope is None else scope

    # -- worker side ---------------------------------------------------------------------------

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that inherits the current one, as Celery 5.5+ does (5.4 pushed a blank
        one: a body behind a custom ``__call__`` saw no id, headers, retries or key)."""
        super().push_request(*args, **{**self.request.__dict__, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if failed_request(args) is not None and not getattr(self.request, "idempotency_errback_",
                                                             False):
            return self._call_as_errback(args, kwargs)
        # Time limits count from the start of the request, and a wait for a busy key spends it.
        started = time.monotonic()
        if (sig := self._call_signature) is not None:
            # Not through the gate: nothing is claimed (a duplicate would wait for a body that
            # never started) or recorded (with typing=False another worker's code may accept it).
            try:
                bind_arguments(sig, args, kwargs)
            except TypeError as exc:
                raise TypeError(f"{self.name}(): {exc}") from None
        req = self.request
        header = (req.headers or {}).get(HEADER)
        if header is None:
            # send_task by name, another language's producer, Task.apply(): derive it here (a
            # period's slot from the message's time, else from now).
            call = identity.identify(self, args, kwargs, None, None, message_time(req),
                                     bool((req.headers or {}).get(BEAT_HEADER)))
            key, digest = call.key, call.fingerprint()
            # A re-queue or retry publishes from these headers: carrying the key, it cannot derive
            # another period slot. Not on a direct call: Celery's one default request is shared
            # by every direct call (celery.map's items), each an action of its own.
            if not req.called_directly:
                req.headers = {**(req.headers or {}), HEADER: key}
        else:
            call = identity.identify(self, args, kwargs, header=header, any_scope=True)
            key, req.idempotency_scope_ = call.key, call.scope
            digest = call.fingerprint()
        if getattr(req, "idempotency_scope_", None) or PRINCIPAL_HEADER in (req.headers or {}):
            identity.SCOPED_BODY.set(True)  # this thread's enqueues now look for their parent
        attempt = Attempt(key=key, task_id=req.id or "", attempt=req.retries or 0, owner=owner_id(),
                          payload_hash=digest)
        req.idempotency_key_ = key
        call_body = super().__call__
        if not (req.is_eager or req.called_directly) and \
                getattr(call_body, "__func__", None) is Task.__call__:
            # In a worker the tracer has pushed the request, and calls run() for a task without
            # its own __call__: do the same.
            call_body = self.run

        def body(token: int) -> Any:
            req.idempotency_token_ = token
            try:
                return call_body(*args, **kwargs)
            except ReceiptFound as found:  # an earlier attempt committed, then died unrecorded
                return found.receipt.value

        return deliver(self, self._gate, self._result_writer, attempt, body, started)

    def _call_as_errback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a new-style errback, ``errback(request, exc, traceback)``, that Celery called
        in-process: under a request of its own keyed by the failed task's id, as
        ``self.request`` may be the failed request (whose key must stay untouched)."""
        key = self.idempotency_key_for(args, kwargs)
        push_fresh_request(self, args=list(args), kwargs=dict(kwargs), headers={HEADER: key},
                           idempotency_errback_=True)
        try:
            return self(*args, **kwargs)
        finally:
            self.pop_request()

    def on_replace(self, sig: Any) -> Any:
        """Publish the replacement (Celery's ``on_replace``) and hand the key's action to it:
        Celery's ``Ignore`` is raised as :class:`Replaced`, so the gate releases the claim
        unrecorded (``docs/limits.md``); in eager mode the replacement runs in place."""
        try:
            return super().on_replace(sig)
        except Replaced:
            raise
        except Ignore as ignore:
            raise Replaced(*ignore.args) from None
