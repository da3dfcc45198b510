"""``IdempotentTask``: the Celery seam. Thin on purpose: the decisions live in ``gate.py``.

Two hooks:

* ``apply_async`` (producer side, and every retry/canvas publish): derive the key from the
  business arguments, put it in the ``idempotency_key`` header, and answer at once, without
  publishing, when the key is already done.
* ``__call__`` (worker side, every pool and eager mode): read the key from the header (or derive
  it, for ``send_task`` by name), and run the body through the gate.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Celery, Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.result import AsyncResult, EagerResult
from celery.signals import worker_init
from celery.states import FAILURE, SUCCESS
from kombu.exceptions import EncodeError
from kombu.serialization import dumps

from . import otel, timelimits
from .codec import KombuCodec
from .config import DEFAULT_TERMINAL_ON, IdempotencyConfig, check_options, resolve
from .durability import REQUIRE_DURABLE_SETTING, check_store
from .events import ANSWERS, EVENT_TYPE, Outcome, log_outcome
from .exceptions import IdempotencyKeyMismatch, ImproperlyConfigured, StoreUnavailable
from .gate import Attempt, Gate, Requeue
from .keys import bind_arguments, key_from_fields, payload_hash, select_fields
from .lease import current_lease
from .records import Record, State
from .results import ResultWriter, result_writer, store_answer
from .stores import store_from_url
from .stores.base import BackendWrite, Store

if TYPE_CHECKING:
    from .receipts import Receipt, ReceiptTransaction

__all__ = ["HEADER", "CachedResult", "IdempotentTask"]

logger = logging.getLogger("celery_idem")

#: Message header that carries the key through retries, redeliveries and canvas.
HEADER = "idempotency_key"
#: Message header counting re-queues of a duplicate that found the key busy (not retries).
REQUEUES_HEADER = "idempotency_requeues"
#: Longest accepted key: it must fit the SQL store's key column with a prefix.
MAX_KEY_LENGTH = 200
#: Fields of the key of a call that does not bind to the signature (``typing=False``), and the
#: field that marks a new-style errback's key. Not identifiers, so no parameter has these names.
UNBOUND_ARGS = "*args"
UNBOUND_KWARGS = "**kwargs"
ERRBACK_FIELD = "$errback"

_stores: weakref.WeakKeyDictionary[Celery, Store] = weakref.WeakKeyDictionary()
_events_on: weakref.WeakSet[Celery] = weakref.WeakSet()
_OWNER = f"{socket.gethostname()}:{os.getpid()}"


def _owner() -> str:
    global _OWNER
    pid = os.getpid()
    if not _OWNER.endswith(f":{pid}"):  # forked worker child
        _OWNER = f"{socket.gethostname()}:{pid}"
    return _OWNER


def get_store(app: Celery) -> Store:
    """The idempotency store of ``app`` (built once per app, from its settings).

    ``idempotency_store`` (a URL or a :class:`Store`) wins; else the ``result_backend`` URL. An
    always-eager app with no usable backend gets an in-process ``memory://`` store.

    Raises:
        ImproperlyConfigured: No supported store can be derived.
    """
    store = _stores.get(app)
    if store is None:
        conf = app.conf
        configured = conf.get("idempotency_store")
        prefix = conf.get("idempotency_key_prefix") or "celery-idem:"
        if isinstance(configured, Store):
            store = configured
        else:
            url = configured or conf.result_backend
            if not url and conf.task_always_eager:
                url = "memory://"
            if not isinstance(url, str):
                url = getattr(url, "url", None) or repr(url)  # a backend class or instance
            # result_backend_transport_options: where Celery users already put a sentinel
            # master_name; only the sentinel:// store reads it.
            store = store_from_url(url, prefix=prefix, options=conf.get("idempotency_store_options"),
                                   backend_transport_options=conf.get(
                                       "result_backend_transport_options"))
        _stores[app] = store
    return store


class ReceiptFound(BaseException):
    """Raised out of ``idempotent_transaction`` when an earlier attempt committed the receipt.

    The task layer turns it into the body's return value (the receipt's result). A
    BaseException, so a body's ``except Exception`` cannot swallow it and carry on.
    """

    def __init__(self, receipt: Receipt) -> None:
        super().__init__(f"receipt found: {receipt!r}")
        self.receipt = receipt


class Replaced(Ignore):  # type: ignore[misc]
    """Celery's ``Ignore`` as :meth:`IdempotentTask.on_replace` raises it: the task was replaced.

    The worker handles it as the ``Ignore`` it is (no state stored for the replaced task); the
    gate sees a hand-over (``handover_signals``) and releases the claim without recording.
    """


class CachedResult(EagerResult):  # type: ignore[misc]
    """The result of an enqueue that found its key already recorded: nothing was published.

    Its value is known, so ``get()`` returns it (or raises the recorded error) at once. It is
    bound to the app's result backend, so it works in a ``ResultSet`` or ``GroupResult`` like
    any ``AsyncResult`` (``get``, ``join``, ``join_native``, ``collect``).

    Attributes:
        id: The task id the caller chose (``task_id=``, a frozen signature, a chain step, a
            chord body), under which the outcome was also stored in the result backend; else
            the task id of the attempt that ran the body (the original task id).
        original_task_id: The task id of the attempt that ran the body.
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

    def then(self, callback: Any, on_error: Any = None, weak: bool = False) -> Any:
        """Call ``callback`` when ready (it is): at once, and again from the result consumer.

        A ResultSet builds a vine barrier over its results' ``then``; a result that is ready
        while the barrier is built is counted before the barrier is finalized and never
        completes it. An AsyncResult that is already ready completes it when the backend's
        result consumer hands it its id's stored meta again during ``join_native``; so does
        this one (a chosen id has its outcome stored, the original id has the run's result).
        """
        if self.backend is not None and self.backend.is_async:
            self._waited_on = True
            self.backend.add_pending_result(self, weak=weak)
        return self.on_ready.then(callback, on_error)

    def _maybe_set_cache(self, meta: Any) -> Any:
        # The result consumer found this id's meta (the same outcome: the value is known).
        self.on_ready(self)
        backend = self.backend
        if self._waited_on and backend is not None:
            self._waited_on = False
            backend.remove_pending_result(self)
        return meta

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _restore_cached, (self.id, self._result, self._state, self._name,
                                 self.idempotency_key, self.original_task_id)

    def __repr__(self) -> str:
        return f"<CachedResult: {self.id} (original {self.original_task_id})>"

    def __del__(self) -> None:
        # Cancel only a wait this handle registered itself (AsyncResult's __del__ cancels
        # unconditionally).
        if getattr(self, "_waited_on", False):
            super().__del__()


def _restore_cached(task_id: str, value: Any, state: str, name: str | None, key: str,
                    original_task_id: str) -> CachedResult:
    """Unpickle (or copy) a :class:`CachedResult`, bound to the current app."""
    from celery import current_app

    rec = Record(key=key, state=State.DONE if state == SUCCESS else State.FAILED, token=0,
                 task_id=original_task_id)
    return CachedResult(rec, value, state, name, task_id=task_id,
                        app=current_app._get_current_object())


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery task whose body runs at most once per business action.

    Subclass it, or pass ``base=IdempotentTask`` to ``@app.task``. Every ``idempotency_*``
    attribute below can be set as a class attribute or as a keyword of ``@app.task``; unknown
    ``idempotency_*`` names are rejected when the task class is created.
    """

    #: Names of the arguments that identify the business action (None: all arguments, with
    #: their defaults applied).
    idempotency_fields: ClassVar[Sequence[str] | None] = None
    #: ``callable(*args, **kwargs) -> str``: the action's identity, used instead of the fields
    #: (the key is ``idempotency_key(operation, identity)``).
    idempotency_key_func: ClassVar[Any] = None
    #: Operation part of the key (default: the task name).
    idempotency_operation: ClassVar[str | None] = None
    #: Seconds a done or failed record lives; after that the action may run again.
    idempotency_ttl: ClassVar[float] = 86400
    #: Seconds a claim lives without a heartbeat; it is renewed every third of it while the body
    #: runs, so only a dead or frozen holder loses it.
    idempotency_lease: ClassVar[float] = 60
    #: Exceptions that release the claim so a retry can run the body again (None: the
    #: timeout-class set of :func:`celery_idem.config.default_release_on`).
    idempotency_release_on: ClassVar[Any] = None
    #: Exceptions recorded as the action's outcome; duplicates re-raise them without running.
    idempotency_terminal_on: ClassVar[Any] = DEFAULT_TERMINAL_ON
    #: Store a hash of the full arguments and refuse the key with other arguments.
    idempotency_validate: ClassVar[bool] = False
    #: Seconds a duplicate waits for a key in progress before re-queueing itself (re-queues
    #: do not count against ``max_retries``). A time limit can cut it shorter: see
    #: ``celery_idem.timelimits``.
    idempotency_wait: ClassVar[float] = 10
    #: Seconds the gate keeps retrying the record of a finished body while the store is down.
    idempotency_record_timeout: ClassVar[float] = 10
    #: Read the record before publishing, so an enqueue of a done key publishes nothing and
    #: returns a :class:`CachedResult`. False saves that store round trip on every enqueue;
    #: a done key's enqueue then publishes a message that the worker answers from the record
    #: (the body still runs at most once, the caller waits for the result as usual).
    idempotency_check_on_enqueue: ClassVar[bool] = True

    #: At-least-once delivery: a message is acknowledged only after the body ran, and
    #: re-delivered if the worker dies. The gate makes the repeats harmless.
    acks_late = True
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        label = str(vars(cls).get("name") or cls.__qualname__)
        check_options(label, vars(cls))
        # Check the values now too, so a wrong option fails at definition, not at first call.
        resolve(label, cls, _signature_of(vars(cls).get("run")))
        timelimits.check_definition(label, cls)

    # -- configuration -------------------------------------------------------------------------

    @cached_property
    def idempotency_config(self) -> IdempotencyConfig:
        """The task's options, checked and frozen (resolved once per task instance)."""
        return resolve(self.name, self, self._signature)

    @cached_property
    def _signature(self) -> inspect.Signature | None:
        return _signature_of(self.run)

    @cached_property
    def _call_signature(self) -> inspect.Signature | None:
        """The signature ``self.run`` is called with: not followed through ``functools.wraps``,
        so a decorator that takes ``*args, **kwargs`` (and may supply an argument) binds any call."""
        try:
            return inspect.signature(self.run, follow_wrapped=False)
        except (TypeError, ValueError):
            return None

    @cached_property
    def _result_writer(self) -> ResultWriter | None:
        return result_writer(self, self._gate.store)

    @cached_property
    def _gate(self) -> Gate:
        app = self.app
        accept = app.conf.result_accept_content or app.conf.accept_content
        return Gate(
            get_store(app),
            self.idempotency_config,
            # Through the backend's prepare_value, as Celery stores results: an AsyncResult a
            # body returns is recorded as its as_tuple(), not refused by the serializer.
            KombuCodec(app.conf.result_serializer, accept,
                       prepare=lambda value: self.backend.prepare_value(value)),
            emit=self._emit,
            # Retry: the task re-published itself; Reject(requeue): it asked for redelivery.
            retry_signals=(Retry, Reject),
            # Task.replace: the replacement, frozen with this task id, now carries the action.
            handover_signals=(Replaced,),
            # The task's own soft limit, fired while it waits for a busy key: re-queue.
            interrupts=(SoftTimeLimitExceeded,),
        )

    # -- the key -------------------------------------------------------------------------------

    def idempotency_key_for(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """Return the key a call with these arguments gets.

        The arguments are keyed as Celery sends them (``pydantic=True`` models dumped), a call
        that does not bind is keyed by its raw arguments when the task has ``typing=False``,
        and a new-style errback call (the failed task's ``Context`` first) by the failed task's
        id: see ``docs/compat.md``.

        Raises:
            TypeError: The arguments do not match the task's signature (and the task checks
                them: ``typing``), or a value that is part of the key has no canonical form
                (the message names the field).
        """
        cfg = self.idempotency_config
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if cfg.key_func is not None:
            identity = cfg.key_func(*args, **kwargs)
            if not isinstance(identity, str) or not identity:
                raise TypeError(
                    f"{self.name}: idempotency_key_func returned {identity!r}; it must return a "
                    f"non-empty str"
                )
            return _check_key(self.name, key_from_fields(cfg.operation, {}, identity))
        fields = self._fields(args, kwargs)
        if _failed_request(args) is not None:
            # Handling a failure is an action of its own, apart from any ordinary call.
            fields[ERRBACK_FIELD] = True
        return _check_key(self.name, key_from_fields(cfg.operation, fields))

    def _key_arguments(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Sequence[Any], Mapping[str, Any]]:
        """The arguments as the key sees them: as Celery sends them, whoever calls.

        * A new-style errback (``errback(request, exc, traceback, *stored)``, called by Celery
          in-process) gets the failed task's id for the request and None for the exception
          and the traceback: neither can be put in a key, and the id names the failure.
        * A ``pydantic=True`` task's models are dumped the way ``apply_async`` dumps them
          (whatever the serializer, so ``apply()``, ``delay()`` and a worker that gets the
          dict agree); a model it leaves alone is keyed by ``model_dump(mode="json")``.
        """
        failed = _failed_request(args)
        if failed is not None:
            args = (failed.id, *(None for _ in args[1:3]), *args[3:])
        dump = getattr(self, "_dump_pydantic_arguments", None)  # Celery >= 5.7
        if dump is not None:
            args, kwargs = dump(args, kwargs)
        return args, kwargs

    def _bound(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, as_sent: bool = True
    ) -> dict[str, Any]:
        if as_sent:
            args, kwargs = self._key_arguments(args, kwargs)
        if self._signature is None:
            return {"args": list(args), "kwargs": dict(kwargs)}
        try:
            return bind_arguments(self._signature, args, kwargs)
        except TypeError as exc:
            if not self._checks_arguments:
                # typing=False: Celery sends a call that does not bind (the worker's signature
                # may differ from this one), so the key must not refuse it. Keyed by the
                # arguments as passed, under names no parameter can have.
                return {UNBOUND_ARGS: list(args), UNBOUND_KWARGS: dict(kwargs)}
            raise TypeError(f"{self.name}{self._signature}: {exc}") from None

    @property
    def _checks_arguments(self) -> bool:
        """Whether Celery checks a call's arguments before sending it (``typing``)."""
        typing = self.typing if self.typing is not None else self.app.strict_typing
        return bool(typing)

    def _fields(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        bound = self._bound(args, kwargs)
        if UNBOUND_ARGS in bound:
            return bound  # a call that does not bind has no named fields to select
        return select_fields(bound, self.idempotency_config.fields)

    @property
    def idempotency_key(self) -> str | None:
        """The key of the business action being run (inside the body), else None."""
        return getattr(self.request, "idempotency_key_", None)

    @property
    def idempotency_token(self) -> int | None:
        """The fencing token of this attempt's claim (inside the body), else None.

        Strictly increasing per key across claims and takeovers: pass it to a remote that
        rejects writes with a token lower than one it has seen.
        """
        return getattr(self.request, "idempotency_token_", None)

    @property
    def idempotency_lease_lost(self) -> bool:
        """True once a renewal found that another attempt took this claim over (inside the body).

        A body about to make a write it cannot take back may check it; the write is refused
        anyway when the outcome is recorded, but the effect would already have happened.
        """
        lease = current_lease.get()
        return lease is not None and lease.lost.is_set()

    def idempotent_transaction(
        self, session_or_connection: Any, *, commit: bool = True, table: str | None = None
    ) -> ReceiptTransaction:
        """Write this action's receipt in the same SQL transaction as the body's own writes.

        Use it inside a bound body (``bind=True``)::

            with self.idempotent_transaction(session) as tx:
                session.add(Order(...))
                tx.result = {"order": 7}
            return tx.result

        On enter, the receipt row (keyed by the idempotency key) is inserted first; if an
        earlier attempt already committed one, the block does not run and the task returns that
        attempt's ``tx.result``. On a clean exit, ``tx.result`` is stored in the receipt and the
        transaction is committed. See ``docs/transactions.md``.

        Args:
            session_or_connection: A SQLAlchemy ``Session`` or ``Connection`` to PostgreSQL,
                MySQL/MariaDB or SQLite (the business database; it need not be the store's).
            commit: True: the block ends with a commit. False: the receipt joins a transaction
                the caller commits.
            table: The receipts table (default ``app.conf.idempotency_receipts_table``, else
                ``celery_idem_receipts``); created on first use.

        Raises:
            RuntimeError: Called outside a running body, inside a saga step, or again in one
                run after a block that was not rolled back by ``idempotent_transaction`` itself.
            TypeError: Not a Session or Connection, or an unsupported database.
            ValueError: The prefixed key is longer than the receipt's 255-character column.
            LeaseLost: On exit, when another attempt took the claim over (rolled back).
        """
        from .receipts import DEFAULT_RECEIPTS_TABLE, ReceiptTransaction  # needs sqlalchemy

        req = self.request
        key, token = self.idempotency_key, self.idempotency_token
        if key is None or token is None:
            raise RuntimeError(
                f"{self.name}: idempotent_transaction must be used inside the running body of "
                f"an IdempotentTask (bind=True, called through the worker, delay() or apply())"
            )
        held = current_lease.get()
        if held is not None and held.key != key:
            # Inside a saga step: the gate holds the step's key, not the task's. A receipt keyed
            # by the task would answer the whole saga with this step's result.
            raise RuntimeError(
                f"{self.name}: idempotent_transaction cannot be used inside a saga step (the "
                f"step runs under its own key {held.key!r}); write the step's receipt-worthy "
                f"effect in the task body, or make the step its own IdempotentTask"
            )
        earlier = getattr(req, "idempotency_receipt_", None)
        if earlier is not None and not earlier.rolled_back:
            # A block it rolled back left no receipt (a body retrying after a deadlock, say);
            # any other earlier block may have committed this action's one receipt.
            raise RuntimeError(
                f"{self.name}: idempotent_transaction was already used in this run of "
                f"{key!r}; one action has one receipt, so put all its writes in one block"
            )
        prefix = self.app.conf.get("idempotency_key_prefix") or "celery-idem:"
        tx = ReceiptTransaction(
            session_or_connection,
            key=prefix + key, token=token, task_id=req.id or "", codec=self._gate.codec,
            ttl=self.idempotency_config.ttl,
            table=table or self.app.conf.get("idempotency_receipts_table") or DEFAULT_RECEIPTS_TABLE,
            commit=commit, lease_lost=lambda: self.idempotency_lease_lost, on_found=ReceiptFound,
        )
        req.idempotency_receipt_ = tx
        return tx

    # -- producer side -------------------------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Publish the task with its key in the ``idempotency_key`` header.

        Takes every option of :meth:`celery.Task.apply_async`, plus ``idempotency_key`` (a
        per-call key used verbatim). When the key is already done (or failed terminally), no
        message is published and a :class:`CachedResult` is returned at once (unless the task
        sets ``idempotency_check_on_enqueue = False``). Either way the result carries the key
        as ``result.idempotency_key``.

        A task id that was chosen (``task_id=``, which is how a frozen signature, a chain's
        next step and a chord body arrive) is kept: the recorded outcome is stored under it in
        the result backend, so anyone waiting on that id hears, and the returned
        :class:`CachedResult` has that id. Without one, the result has the original task id.

        Raises:
            TypeError: The key cannot be derived from the arguments; nothing was published.
            ValueError: The per-call key is empty or too long.
        """
        explicit = options.pop(HEADER, None)
        headers = dict(options.pop("headers", None) or {})
        key = explicit if explicit is not None else headers.get(HEADER)
        if key is None:
            key = self.idempotency_key_for(args, kwargs)
        else:
            _check_key(self.name, key)
        headers[HEADER] = key
        # A publish by the task itself (retry, re-queue) or one that carries a canvas must go out:
        # answering it from the cache would strand the retry or drop the rest of the workflow.
        # A chain's last step (chain=[]) and a link callback (no link) are answered here: under
        # the task id they carry when frozen (a chain step always is), else under the original.
        republish = bool(options.get("retries")) or REQUEUES_HEADER in headers
        canvas = link or link_error or options.get("chain") or options.get("chord") \
            or options.get("group_id")
        if not republish and not canvas and self.idempotency_config.check_on_enqueue:
            cached = self._cached(key, args, kwargs, task_id, options)
            if cached is not None:
                return cached
        try:
            result: AsyncResult = super().apply_async(
                args, kwargs, task_id=task_id, producer=producer, link=link,
                link_error=link_error, shadow=shadow, headers=headers, **options,
            )
        except EncodeError as exc:
            raise self._encode_error(args, kwargs, options.get("serializer"), exc) from exc
        # So a caller (an agent keeping a checkpoint, say) can store the key with the task id.
        result.idempotency_key = key
        return result

    def _encode_error(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
        serializer: str | None, exc: Exception,
    ) -> TypeError:
        """Name the argument the message serializer could not encode (nothing was sent)."""
        serializer = serializer or self.serializer or self.app.conf.task_serializer
        try:
            bound = self._bound(args or (), kwargs or {}, as_sent=False)
        except TypeError:
            bound = {}
        for name, value in bound.items():
            try:
                dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
            except Exception:
                return TypeError(
                    f"{self.name}: argument {name!r} ({type(value).__qualname__}) cannot be "
                    f"sent with the {serializer!r} serializer: {exc}; nothing was sent"
                )
        return TypeError(f"{self.name}: the message cannot be encoded: {exc}; nothing was sent")

    def _cached(
        self, key: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
        task_id: str | None = None, options: Mapping[str, Any] | None = None,
    ) -> CachedResult | None:
        """The answer from the record for an enqueue of a done (or failed) key, or None: publish.

        One store round trip (the record's read), plus one to store the answer under a task id
        the caller chose (see :func:`celery_idem.results.store_answer`).
        """
        try:
            rec = self._gate.store.get(key)
        except StoreUnavailable as exc:
            # The worker's gate still guards the body; publishing is safe.
            logger.debug("celery_idem enqueue check skipped key=%s: %s", key, exc)
            return None
        if rec is None or rec.state not in (State.DONE, State.FAILED):
            return None
        if (
            self.idempotency_config.validate
            and rec.payload_hash
            and payload_hash(self._bound(args or (), kwargs or {})) != rec.payload_hash
        ):
            self._emit_enqueue(Outcome.MISMATCH, rec, task_id or rec.task_id)
            raise IdempotencyKeyMismatch(
                f"idempotency key {key!r} was first used with different arguments (task "
                f"{rec.task_id}); use a new key for a new action. Nothing was sent.",
                key=key,
            )
        codec = self._gate.codec
        value: Any
        if rec.state is State.FAILED:
            state, value = FAILURE, codec.decode_error(rec.key, rec.content_type or "", rec.data or b"")
        else:
            state, value = SUCCESS, codec.decode_result(rec.key, rec.content_type or "", rec.data or b"")
        options = options or {}
        conf = self.app.conf
        eager = conf.task_always_eager
        if task_id and task_id != rec.task_id and (not eager or conf.task_store_eager_result):
            # Someone may be waiting on this id (the caller, a chain's result, a parent's
            # children): Celery would store the outcome under it, so store it. If that fails,
            # publish, and the worker answers the message from the record. (The original id
            # holds the run's own result already, with its children: not overwritten.)
            request = self._answer_request(task_id, args, kwargs, options)
            if not store_answer(self, self._result_writer, request, value, state):
                return None
        result = CachedResult(rec, value, state, name=self.name, task_id=task_id, app=self.app)
        self._emit_enqueue(Outcome.ANSWERED, rec, result.id)
        if not eager and options.get("add_to_parent", True):
            # As send_task does: the running task lists it among its children.
            parent = self.app.current_worker_task
            if parent:
                parent.add_trail(result)
        return result

    def _answer_request(
        self, task_id: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> Context:
        """The request Celery's backend would store a result of ``task_id`` with."""
        parent = self.app.current_worker_task
        parent_id, root_id = options.get("parent_id"), options.get("root_id")
        if parent:  # as send_task fills them in
            parent_id = parent_id or parent.request.id
            root_id = root_id or parent.request.root_id or parent.request.id
        fields: dict[str, Any] = {
            "id": task_id, "task": self.name, "args": list(args or ()),
            "kwargs": dict(kwargs or {}), "called_directly": False, "is_eager": False,
            "parent_id": parent_id, "root_id": root_id, "group": options.get("group_id"),
            "group_index": options.get("group_index"),
            # The rpc:// backend replies to the caller's queue, as send_task's reply_to does.
            "reply_to": options.get("reply_to") or self.app.thread_oid,
            "correlation_id": task_id,
        }
        ignore = options.get("ignore_result", self.ignore_result)
        if ignore is not None:  # unset: get_actual_ignore_result falls back to the task's
            fields["ignore_result"] = ignore
        return Context(fields)

    # -- worker side ---------------------------------------------------------------------------

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that inherits the current one (Celery 5.5+'s own behaviour).

        ``Task.__call__`` pushes a request for the body; Celery 5.4 pushed a blank one, so a body
        behind a custom ``__call__`` saw no id, headers, retries or idempotency key.
        """
        self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _failed_request(args) is not None and not getattr(self.request, "idempotency_errback_",
                                                             False):
            return self._call_as_errback(args, kwargs)
        # Time limits count from the start of the request, and a wait for a busy key spends it.
        started = time.monotonic()
        self._check_call(args, kwargs)
        req = self.request
        key = (req.headers or {}).get(HEADER) or self.idempotency_key_for(args, kwargs)
        cfg = self.idempotency_config
        attempt = Attempt(
            key=key,
            task_id=req.id or "",
            attempt=req.retries or 0,
            owner=_owner(),
            payload_hash=payload_hash(self._bound(args, kwargs)) if cfg.validate else None,
        )
        req.idempotency_key_ = key
        call_body = super().__call__
        writer = self._result_writer
        built: list[BackendWrite] = []

        def also(result: Any) -> BackendWrite | None:
            assert writer is not None  # passed to the gate only when there is one
            write = writer.build(req, result)
            if write is not None:
                built.append(write)
            return write

        def body(token: int) -> Any:
            req.idempotency_token_ = token
            try:
                return call_body(*args, **kwargs)
            except ReceiptFound as found:
                # An earlier attempt committed the body's transaction and died before the
                # record: its result is the action's, and the gate records it as usual.
                return found.receipt.value

        local = req.is_eager or req.called_directly
        # No pool enforces a limit in the calling process (eager mode, a direct call).
        deadline = None if local else timelimits.request_deadline(self, req, started)
        while True:
            try:
                result = self._gate.run(attempt, body,
                                        also if writer is not None and writer.folds else None,
                                        deadline=deadline)
            except Requeue as busy:
                if local:
                    if isinstance(busy.__cause__, SoftTimeLimitExceeded):
                        # A direct call inside another task's body: that task's own limit.
                        raise busy.__cause__ from None
                    continue  # no broker to re-queue to: wait another round in place
                # A freed key is claimed by the next delivery at once; a busy one is looked
                # at again a second later.
                self._requeue(countdown=0.0 if busy.freed else 1.0, reason=str(busy))
            except StoreUnavailable as down:
                if local:
                    raise
                self._emit(Outcome.REQUEUED, key, 0, req.id or "", {"reason": "store_unavailable"})
                n = int((req.headers or {}).get(REQUEUES_HEADER, 0))
                self._requeue(countdown=min(2.0 ** n, 30.0), reason=str(down), exc=down)
            else:
                if writer is not None:
                    self._write_result(writer, req, result, built[-1] if built else None)
                return result

    def _check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError, without claiming the key, when the body cannot be called with these
        arguments (a ``typing=False`` task, or a message from a producer whose signature of the
        task differs).

        Such a call fails before the first line of the body, so no effect can have happened,
        and the gate is not entered: nothing is claimed and nothing is recorded. Not held, as an
        unclassified error would be: a duplicate would wait for the lease of a body that never
        started. Not recorded as terminal either: the call fails only against this worker's code
        (``typing=False`` exists because the producer's signature may differ from the worker's),
        and a record would fail the action for ``idempotency_ttl`` on a worker that accepts it.
        Every delivery of the message fails the same way, as in plain Celery, and the FAILURE
        Celery stores for it reaches the caller at once.
        """
        sig = self._call_signature
        if sig is None:
            return
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from None

    def _call_as_errback(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a new-style errback, ``errback(request, exc, traceback)``, that Celery called.

        Celery calls it in-process from the failed task's failure handling
        (``Backend._call_task_errbacks``), not through a message. ``self.request`` is then not
        this errback's: it is the default request, or the failed request itself when a task is
        its own errback (whose key and result must stay untouched). So the errback runs under a
        request of its own, through the gate, keyed by the failed task's id
        (:meth:`_key_arguments`): a failure handled twice (a redelivered message) runs it once.
        """
        key = self.idempotency_key_for(args, kwargs)
        self.request_stack.push(Context(args=list(args), kwargs=dict(kwargs), headers={HEADER: key},
                                        idempotency_errback_=True))
        try:
            return self(*args, **kwargs)
        finally:
            self.request_stack.pop()

    def on_replace(self, sig: Any) -> Any:
        """Publish the replacement (Celery's ``on_replace``) and hand the key's action to it.

        Celery ends the replaced task by raising ``Ignore`` after publishing ``sig``, which it
        froze with this task's id, so the outcome lands under that id. It is raised here as
        :class:`Replaced`, which the gate releases the claim on without recording: the action's
        outcome is the replacement's, and each IdempotentTask in it is gated under its own key.
        A duplicate of the replaced call runs its body again and replaces it again (see
        ``docs/limits.md``). In eager mode the replacement runs in place and its result is the
        body's, recorded as usual.
        """
        try:
            return super().on_replace(sig)
        except Replaced:
            raise
        except Ignore as ignore:
            raise Replaced(*ignore.args) from None

    @staticmethod
    def _write_result(
        writer: ResultWriter, req: Any, result: Any, folded: BackendWrite | None
    ) -> None:
        """Store the result in one round trip (celery_idem/results.py), or leave it to Celery."""
        if folded is None or not folded.written:
            # Not folded (another server, a duplicate answered from its record, an ACL that
            # refused the script's write): SET + PUBLISH without the backend's GET.
            write = folded or writer.build(req, result)
            if write is None or not writer.write(write):
                return
        # Stored: Celery must not write it again (mark_as_done skips the store when the
        # request ignores results).
        req.ignore_result = True

    def _requeue(self, countdown: float, reason: str, exc: BaseException | None = None) -> None:
        """Publish this message again (same task id, same ``retries``) and end this attempt."""
        req = self.request
        headers = dict(req.headers or {})
        headers[REQUEUES_HEADER] = int(headers.get(REQUEUES_HEADER, 0)) + 1
        sig = self.signature_from_request(req, countdown=countdown, retries=req.retries,
                                          headers=headers)
        try:
            sig.apply_async()
        except Exception as publish_error:
            # Cannot publish: hand the message back to the broker instead of losing it.
            raise Reject(publish_error, requeue=True) from publish_error
        raise Retry(f"celery_idem re-queued: {reason}", exc=exc, when=countdown, sig=sig)

    # -- events --------------------------------------------------------------------------------

    def _emit(self, outcome: Outcome, key: str, token: int, original: str, extra: dict[str, Any]) -> None:
        req = self.request
        log_outcome(outcome, key, token, original, req.id or "", extra,
                    answers=outcome not in ANSWERS or self._log_answers)
        if otel.ENABLED:
            otel.observe(self.name, outcome.value, key, token, original, task_span=True)
        if req.is_eager or req.called_directly or self.app not in _events_on:
            return
        try:
            self.send_event(
                EVENT_TYPE, retry=False, idempotency_key=key, outcome=outcome.value,
                original_task_id=original, token=token, **extra,
            )
        except Exception as exc:  # monitoring must never change the outcome
            logger.debug("celery_idem event not sent key=%s: %s", key, exc)


    @property
    def _log_answers(self) -> bool:
        """Whether answers log at INFO (``idempotency_log_answers``, on unless False)."""
        return self.app.conf.get("idempotency_log_answers", True) is not False

    def _emit_enqueue(self, outcome: Outcome, rec: Record, result_id: str) -> None:
        """Report a decision ``apply_async`` made from the record: nothing was published.

        A log line (INFO, like a worker's duplicate); a ``task-idempotency`` event (with the
        task's name, under the returned result's id) only when this process sends events
        (``idempotency_events``, ``task_send_sent_event``, or a worker started with ``-E``), so
        with events off an answer costs one log call and no broker round trip.
        """
        conf = self.app.conf
        extra = {"record_state": rec.state.value, "at": "enqueue"}
        log_outcome(outcome, rec.key, rec.token, rec.task_id, result_id, extra,
                    answers=self._log_answers)
        if otel.ENABLED:
            otel.observe(self.name, outcome.value, rec.key, rec.token, rec.task_id, task_span=False)
        if not (conf.get("idempotency_events") or conf.task_send_sent_event
                or self.app in _events_on) or conf.task_always_eager:
            return
        try:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send(
                    EVENT_TYPE, uuid=result_id, name=self.name, idempotency_key=rec.key,
                    outcome=outcome.value, original_task_id=rec.task_id, token=rec.token, **extra,
                )
        except Exception as exc:  # monitoring must never change the answer
            logger.debug("celery_idem event not sent key=%s: %s", rec.key, exc)


def _signature_of(run: Any) -> inspect.Signature | None:
    if isinstance(run, staticmethod):
        run = run.__func__
    if run is None:
        return None
    try:
        sig = inspect.signature(run)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if getattr(run, "__self__", None) is None and params and params[0].name == "self":
        # An unbound ``bind=True`` body: ``self`` is the task, not a business argument.
        sig = sig.replace(parameters=params[1:])
    return sig


def _failed_request(args: Sequence[Any]) -> Context | None:
    """The failed task's request when ``args`` are those of a new-style errback call, else None.

    Celery passes the failed task's ``Context`` first; a message never carries one, so it is
    never a business argument.
    """
    first = args[0] if args else None
    return first if isinstance(first, Context) else None


def _check_key(task: str, key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{task}: idempotency_key must be a non-empty str, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"{task}: idempotency_key is {len(key)} characters; the limit is {MAX_KEY_LENGTH} "
            f"(hash long identities with celery_idem.idempotency_key)"
        )
    return key


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _check_worker(sender: Any = None, **_: Any) -> None:
    """Fail the worker at start-up, not the first message, when the store or a time limit is
    misconfigured; warn once about time limits that only degrade."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    if getattr(sender, "task_events", False) or app.conf.get("idempotency_events") \
            or app.conf.worker_send_task_events:
        _events_on.add(app)
    tasks = [task for task in app.tasks.values() if isinstance(task, IdempotentTask)]
    if tasks:
        try:
            store = get_store(app)
            timelimits.check_worker(app, tasks, getattr(sender, "time_limit", None),
                                    getattr(sender, "soft_time_limit", None))
            check_store(store, require=bool(app.conf.get(REQUIRE_DURABLE_SETTING)))
        except ImproperlyConfigured as exc:
            # Celery logs and swallows exceptions raised by signal handlers, and the worker would
            # start consuming messages it can only fail: stop it here, with the reason.
            logger.critical("celery_idem: %s", exc)
            raise SystemExit(f"celery_idem: the worker cannot start: {exc}") from exc
