"""Sagas: several keyed steps, with compensations, in one ``IdempotentTask`` body.

::

    @app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
    def checkout(self, order_id, amount_cents, email):
        saga = Saga(self)
        charge = saga.step("charge", charge_card, order_id, amount_cents, compensate=refund)
        order = saga.step("create_order", create_order, order_id, charge["id"], compensate=cancel)
        saga.step("send_receipt", send_receipt, email, order["id"])
        return {"charge": charge["id"], "order": order["id"]}

The saga's key is the task's key. Each step runs through the same gate as a task body, under
its own key, ``idempotency_key("saga.<name>", saga_key)``: the first run claims it, runs the step
and records its result; a resumed saga (broker redelivery, a retry, a duplicate) gets the
recorded result without running the step again; a step whose holder died is taken over once its
lease runs out, with a higher fencing token. A step function is called as
``fn(step, *args, **kwargs)``, where ``step`` (:class:`Step`) carries the step's own key and token
to forward to the remote.

When a step fails terminally (an exception in the task's ``idempotency_terminal_on``, such as
:class:`~celery_idem.TerminalError`), the compensations of the steps completed before it run in
reverse order, each keyed ``idempotency_key("saga.<name>.compensate", saga_key)`` so that each
runs once even when the compensation run is itself killed and resumed; then :class:`SagaFailed`
(a ``TerminalError``) is raised, so the task records the saga as failed.

Idempotency is not a transaction: between a step and its compensation, other parties can see
the step's effect. See ``docs/sagas.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from ..app import owner_id
from ..exceptions import LeaseLost, StoreUnavailable, TerminalError
from ..gate import Attempt, Gate, Requeue
from ..keys import idempotency_key, payload_hash
from ..lease import current_lease
from ..stores.base import Fence

if TYPE_CHECKING:
    from ..task import IdempotentTask

__all__ = ["CompensationFailed", "Saga", "SagaFailed", "Step", "step_key"]

#: Step names: short identifiers, so the key's readable prefix stays readable and a name can
#: never end like a compensation's (``.compensate``).
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")


class SagaFailed(TerminalError):
    """A step failed terminally; the completed steps were compensated.

    A ``TerminalError``: the saga task records it, and duplicates of the saga re-raise it.

    Attributes:
        step: The step that failed (None when rebuilt from a record).
        compensated: The steps whose compensation ran (or had run), in the order they ran.
    """

    def __init__(self, message: str, step: str | None = None,
                 compensated: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.compensated = tuple(compensated)

    def __reduce__(self) -> tuple[type, tuple[str, str | None, tuple[str, ...]]]:
        return (type(self), (str(self), self.step, self.compensated))


class CompensationFailed(SagaFailed):
    """A step failed terminally and at least one compensation failed terminally too.

    Every other compensation still ran. The saga needs a person: the message names the
    compensations that failed.
    """


@dataclass(frozen=True)
class Step:
    """What a step function gets as its first argument.

    Attributes:
        name: The step's name (a compensation has its step's name).
        saga_key: The saga's key (the task's ``idempotency_key``).
        idempotency_key: This step's own key: forward it to the remote.
        idempotency_token: This step's fencing token: forward it to a remote that refuses
            lower tokens (see ``docs/fencing.md``).
        compensating: True when this is the step's compensation.
    """

    name: str
    saga_key: str
    idempotency_key: str
    idempotency_token: int
    compensating: bool = False

    @property
    def lease_lost(self) -> bool:
        """True once a renewal found that another attempt took this step over."""
        lease = current_lease.get()
        return lease is not None and lease.key == self.idempotency_key and lease.lost.is_set()


def step_key(saga_key: str, name: str, *, compensate: bool = False) -> str:
    """The key of one step of a saga (``compensate``: of its compensation).

    ``saga.<name>:<hash of the saga key>`` and ``saga.<name>.compensate:<...>``: stable across
    processes, so a resumed saga finds the records of the steps it already ran.

    Raises:
        ValueError: ``name`` is not 1-64 letters, digits, ``_`` or ``-``.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"saga step name must be 1-64 letters, digits, '_' or '-', got {name!r}"
        )
    return idempotency_key(f"saga.{name}.compensate" if compensate else f"saga.{name}", saga_key)


class Saga:
    """Runs keyed steps of one saga inside a running ``IdempotentTask`` body (``bind=True``).

    Args:
        task: The running task (``self`` of a bound body). Its key is the saga's key; its
            options (lease, TTL, terminal and release errors, validation) apply to every step.

    Raises:
        RuntimeError: Not called inside a running body of an IdempotentTask.

    The object may also be used as a context manager: a ``terminal_on`` error raised by the
    body *between* steps inside the block compensates the completed steps as well.
    """

    def __init__(self, task: IdempotentTask) -> None:
        key, token = task.idempotency_key, task.idempotency_token
        if key is None or token is None:
            raise RuntimeError(
                f"{task.name}: a Saga must be created inside the running body of an "
                f"IdempotentTask (bind=True, through the worker, delay() or apply())"
            )
        self.task = task
        self.key: str = key
        self.token: int = token
        outer = task.idempotency_gate
        cfg = outer.config
        # A step found busy is held by an earlier, dead or frozen, run of this same saga (this
        # run holds the saga key): wait out a whole lease in place instead of re-queueing.
        self._gate = Gate(
            outer.store, replace(cfg, wait=max(cfg.wait, 2 * cfg.lease)), outer.codec,
            emit=outer.emit, retry_signals=outer.retry_signals,
        )
        #: Results of the steps completed in this run, by name, in order.
        self.results: dict[str, Any] = {}
        self._compensations: dict[str, Callable[..., Any] | None] = {}
        self._failed = False

    # -- steps ---------------------------------------------------------------------------------

    def step(self, name: str, fn: Callable[..., Any], /, *args: Any,
             compensate: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """Run ``fn(step, *args, **kwargs)`` once per saga, and return its (recorded) result.

        Args:
            name: The step's name, unique within the saga (part of its key).
            fn: The step; its first argument is a :class:`Step`.
            *args: Passed to ``fn``.
            compensate: ``compensate(step, result)`` undoes the step; it runs (once) when a
                later step fails terminally.
            **kwargs: Passed to ``fn``.

        Returns:
            The step's result as the store returns it (the same value on the first run and on
            a resume: it is always passed through the result serializer).

        Raises:
            SagaFailed: This step failed terminally; the earlier steps were compensated.
            CompensationFailed: ... and a compensation failed terminally too.
            LeaseLost: Another run of the saga took it over; this run must stop.
            ValueError: A bad or repeated step name.
            BaseException: A non-terminal error of the step (timeouts release the step and the
                saga, so a retry of the saga resumes here).
        """
        if self._failed:
            raise RuntimeError(f"saga {self.key!r} has failed; no further step may run")
        key = step_key(self.key, name)
        if name in self._compensations:
            raise ValueError(f"saga {self.key!r}: step {name!r} already ran in this saga; "
                             f"give each step its own name")
        if compensate is not None and not callable(compensate):
            raise TypeError(f"saga step {name!r}: compensate must be callable, got {compensate!r}")
        try:
            result = self._run(name, key, fn, args, kwargs, compensating=False)
        except self._gate.config.terminal_on as exc:
            self._abort(f"step {name!r}", name, exc)
        self._compensations[name] = compensate
        self.results[name] = result
        return result

    def __enter__(self) -> Saga:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None or self._failed or not isinstance(exc, self._gate.config.terminal_on):
            return
        last = next(reversed(self.results), None)
        self._abort("the saga body" + (f" after step {last!r}" if last else ""), None, exc)

    # -- internals -----------------------------------------------------------------------------

    def _run(self, name: str, key: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], *, compensating: bool) -> Any:
        req = self.task.request
        gate = self._gate
        digest = None
        if gate.config.validate and not compensating:
            digest = payload_hash({"args": list(args), "kwargs": kwargs})
        attempt = Attempt(key=key, task_id=req.id or "", attempt=req.retries or 0,
                          owner=owner_id(), payload_hash=digest)

        def body(token: int) -> Any:
            return fn(Step(name, self.key, key, token, compensating), *args, **kwargs)

        while True:
            self._check_saga_lease(name)
            try:
                result = gate.run(attempt, body).value
            except Requeue:
                continue  # still held by a live earlier run; ours is the saga's claim: wait on
            # The same value whether the step ran now or is answered from its record, so the
            # saga's code takes the same path on a resume.
            ctype, data = gate.codec.encode_result(result)
            return gate.codec.decode_result(key, ctype, data)

    def _check_saga_lease(self, name: str) -> None:
        """Refuse to start a step when another run has taken the saga over (fenced renew)."""
        try:
            held = current_lease.get()
            # The saga's own claim (the task's) is named by its claim id too.
            fence = held.fence if held is not None and held.key == self.key \
                and held.token == self.token else Fence(self.token)
            self._gate.store.renew(self.key, fence.token, self._gate.config.lease,
                                   claim_id=fence.claim_id)
        except LeaseLost as exc:
            raise LeaseLost(
                f"saga {self.key!r} was taken over by another run (this run's token "
                f"{self.token}); step {name!r} was not started: {exc}",
                key=self.key, token=self.token,
            ) from exc
        except StoreUnavailable:
            pass  # the step's claim reaches the same store and decides (it raises if still down)

    def _abort(self, where: str, step: str | None, exc: BaseException) -> NoReturn:
        """Compensate the completed steps, newest first, each once; then raise SagaFailed."""
        self._failed = True
        terminal = self._gate.config.terminal_on
        compensated: list[str] = []
        failures: list[str] = []
        for name in reversed(list(self._compensations)):
            compensate = self._compensations[name]
            if compensate is None:
                continue
            key = step_key(self.key, name, compensate=True)
            try:
                self._run(name, key, compensate, (self.results[name],), {}, compensating=True)
            except terminal as failed:
                failures.append(f"{name} ({type(failed).__name__}: {failed})")
                continue
            compensated.append(name)
        cause = f"{type(exc).__name__}: {exc}"
        done = ", ".join(compensated) or "none"
        if failures:
            raise CompensationFailed(
                f"saga {self.key!r} failed in {where} ({cause}); compensated: {done}; "
                f"compensation FAILED for: {', '.join(failures)}",
                step, compensated,
            ) from exc
        raise SagaFailed(f"saga {self.key!r} failed in {where} ({cause}); compensated: {done}",
                         step, compensated) from exc
