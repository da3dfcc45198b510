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
import weakref
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Celery, Task
from celery.app.task import Context
from celery.exceptions import Reject, Retry
from celery.result import AsyncResult, EagerResult
from celery.signals import worker_init
from celery.states import FAILURE, SUCCESS
from kombu.exceptions import EncodeError
from kombu.serialization import dumps

from .codec import KombuCodec
from .config import DEFAULT_TERMINAL_ON, IdempotencyConfig, check_options, resolve
from .events import EVENT_TYPE, Outcome, log_outcome
from .exceptions import IdempotencyKeyMismatch, ImproperlyConfigured, StoreUnavailable
from .gate import Attempt, Gate, Requeue
from .keys import bind_arguments, key_from_fields, payload_hash, select_fields
from .lease import current_lease
from .records import Record, State
from .results import ResultWriter, result_writer
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


class CachedResult(EagerResult):  # type: ignore[misc]
    """The result of an enqueue that found its key already recorded: nothing was published.

    Attributes:
        id: The task id of the attempt that ran the body (the original task id).
        idempotency_key: The key.
    """

    def __init__(self, record: Record, value: Any, state: str, name: str | None = None) -> None:
        super().__init__(record.task_id, value, state, name=name)
        self.idempotency_key = record.key
        self.original_task_id = record.task_id


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
    #: do not count against ``max_retries``).
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

    # -- configuration -------------------------------------------------------------------------

    @cached_property
    def idempotency_config(self) -> IdempotencyConfig:
        """The task's options, checked and frozen (resolved once per task instance)."""
        return resolve(self.name, self, self._signature)

    @cached_property
    def _signature(self) -> inspect.Signature | None:
        return _signature_of(self.run)

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
            KombuCodec(app.conf.result_serializer, accept),
            emit=self._emit,
            # Retry: the task re-published itself; Reject(requeue): it asked for redelivery.
            retry_signals=(Retry, Reject),
        )

    # -- the key -------------------------------------------------------------------------------

    def idempotency_key_for(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """Return the key a call with these arguments gets.

        Raises:
            TypeError: The arguments do not match the task's signature, or a value that is
                part of the key has no canonical form (the message names the field).
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
        return _check_key(self.name, key_from_fields(cfg.operation, self._fields(args, kwargs)))

    def _bound(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if self._signature is None:
            return {"args": list(args), "kwargs": dict(kwargs)}
        try:
            return bind_arguments(self._signature, args, kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}{self._signature}: {exc}") from None

    def _fields(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return select_fields(self._bound(args, kwargs), self.idempotency_config.fields)

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
        # A publish by the task itself (retry, re-queue), one that carries a canvas, or one whose
        # task id was chosen beforehand (a chain's next step, a chord's body, a frozen signature:
        # someone waits on that id) must go out: answering it from the cache would strand the
        # retry, drop the rest of the workflow or leave that id without a result. The worker
        # answers it from the record without running the body.
        republish = bool(options.get("retries")) or REQUEUES_HEADER in headers
        canvas = link or link_error or options.get("chain") or options.get("chord") \
            or options.get("group_id") or task_id is not None
        if not republish and not canvas and self.idempotency_config.check_on_enqueue:
            cached = self._cached(key, args, kwargs)
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
            bound = self._bound(args or (), kwargs or {})
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
        self, key: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> CachedResult | None:
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
            raise IdempotencyKeyMismatch(
                f"idempotency key {key!r} was first used with different arguments (task "
                f"{rec.task_id}); use a new key for a new action. Nothing was sent.",
                key=key,
            )
        codec = self._gate.codec
        if rec.state is State.FAILED:
            error = codec.decode_error(rec.key, rec.content_type or "", rec.data or b"")
            return CachedResult(rec, error, FAILURE, name=self.name)
        value = codec.decode_result(rec.key, rec.content_type or "", rec.data or b"")
        return CachedResult(rec, value, SUCCESS, name=self.name)

    # -- worker side ---------------------------------------------------------------------------

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that inherits the current one (Celery 5.5+'s own behaviour).

        ``Task.__call__`` pushes a request for the body; Celery 5.4 pushed a blank one, so a body
        behind a custom ``__call__`` saw no id, headers, retries or idempotency key.
        """
        self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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

        while True:
            try:
                result = self._gate.run(attempt, body,
                                        also if writer is not None and writer.folds else None)
            except Requeue as busy:
                if req.is_eager or req.called_directly:
                    continue  # no broker to re-queue to: wait another round in place
                self._requeue(countdown=1.0, reason=str(busy))
            except StoreUnavailable as down:
                if req.is_eager or req.called_directly:
                    raise
                self._emit(Outcome.REQUEUED, key, 0, req.id or "", {"reason": "store_unavailable"})
                n = int((req.headers or {}).get(REQUEUES_HEADER, 0))
                self._requeue(countdown=min(2.0 ** n, 30.0), reason=str(down), exc=down)
            else:
                if writer is not None:
                    self._write_result(writer, req, result, built[-1] if built else None)
                return result

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
        log_outcome(outcome, key, token, original, req.id or "", extra)
        if req.is_eager or req.called_directly or self.app not in _events_on:
            return
        try:
            self.send_event(
                EVENT_TYPE, retry=False, idempotency_key=key, outcome=outcome.value,
                original_task_id=original, token=token, **extra,
            )
        except Exception as exc:  # monitoring must never change the outcome
            logger.debug("celery_idem event not sent key=%s: %s", key, exc)


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
    """Fail the worker at start-up, not the first message, when the store is misconfigured."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    if getattr(sender, "task_events", False) or app.conf.get("idempotency_events") \
            or app.conf.worker_send_task_events:
        _events_on.add(app)
    if any(isinstance(task, IdempotentTask) for task in app.tasks.values()):
        try:
            get_store(app)
        except ImproperlyConfigured as exc:
            # Celery logs and swallows exceptions raised by signal handlers, and the worker would
            # start consuming messages it can only fail: stop it here, with the reason.
            logger.critical("celery_idem: %s", exc)
            raise SystemExit(f"celery_idem: the worker cannot start: {exc}") from exc
