"""The gate: the state machine around one execution of a task body. Celery-free.

::

    claim ──CLAIMED/TAKEOVER──> run body (lease renewed) ──ok──────────> record DONE
      │                                    ├─ terminal_on ───────────> record FAILED, raise
      │                                    ├─ release_on / retry ────> release, raise
      │                                    ├─ handover ──────────────> release (record nothing), raise
      │                                    └─ anything else ─────────> hold until lease expiry, raise
      ├─DONE/FAILED────> return the recorded result / raise the recorded error (no body)
      ├─MISMATCH───────> raise IdempotencyKeyMismatch (no body)
      └─BUSY───────────> wait (bounded) for the holder ──outcome──> as DONE/FAILED
                                    ├─ freed or lease expired ──> claim again
                                    │    (under a deadline: raise Requeue, freed)
                                    └─ still busy ──────────────> raise Requeue

The task layer supplies the key, the body and a codec, and re-queues the message on
:class:`Requeue` and :class:`~celery_idem.exceptions.StoreUnavailable`. No Celery, no kombu here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar

from .codec import Codec
from .config import IdempotencyConfig
from .events import Emit, Outcome
from .exceptions import IdempotencyKeyMismatch, LeaseLost, StoreUnavailable, TerminalError
from .lease import LeaseKeeper, keeper
from .records import Claim, ClaimStatus, Record, State
from .stores.base import BackendWrite, Fence, Store

__all__ = ["Attempt", "Gate", "Requeue", "RunOutcome"]

logger = logging.getLogger("celery_idem")

T = TypeVar("T")


@dataclass(frozen=True)
class Attempt:
    """One execution attempt as the gate sees it: its key, task id, ``retries`` count (a higher
    one may take over its own claim), owner (``host:pid``) and fingerprint (None: none)."""

    key: str
    task_id: str
    attempt: int = 0
    owner: str = ""
    payload_hash: str | None = None


@dataclass(frozen=True)
class RunOutcome(Generic[T]):
    """What :meth:`Gate.run` did for one attempt: ``value`` (the body's result, or the recorded
    one), whether this attempt ``ran`` the body, the backend ``write`` that ``fold`` built (None:
    none), and whether it was ``folded`` into the record's store call (the caller skips it)."""

    value: T
    ran: bool
    write: BackendWrite | None = None
    folded: bool = False


class Requeue(Exception):
    """Raised when this attempt should go round again instead of running the body: ``holder`` is
    the record last seen (None: gone or unknown), ``freed`` whether the next attempt may claim."""

    def __init__(self, key: str, holder: Record | None, *, freed: bool = False) -> None:
        state = "free now" if freed else "still in progress"
        super().__init__(f"{key!r} is {state}; re-queue and look again later")
        self.key = key
        self.holder = holder
        self.freed = freed


def _no_emit(outcome: Outcome, key: str, token: int, original: str, extra: dict[str, Any]) -> None:
    return None


@dataclass(eq=False)
class Gate:
    """Runs a body at most once per key, with the store's atomic verbs.

    Args:
        store: The store of records.
        config: The task's resolved options.
        codec: Encodes results and errors for the store.
        emit: Called once per decision.
        retry_signals: "The task re-published itself" (Celery's ``Retry``): the claim is released.
        handover_signals: "The body handed its action to another task" (``Task.replace``):
            nothing is recorded, the claim is released.
        interrupts: The task's soft time limit: a :class:`Requeue` while claiming or waiting;
            raised by the body, any error.
        sleep, monotonic: Injectable for tests.
        lease_keeper: Renews the lease while the body runs (default: the process's).
    """

    store: Store
    config: IdempotencyConfig
    codec: Codec
    _: KW_ONLY
    emit: Emit = _no_emit
    retry_signals: tuple[type[BaseException], ...] = ()
    handover_signals: tuple[type[BaseException], ...] = ()
    interrupts: tuple[type[BaseException], ...] = ()
    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic
    lease_keeper: LeaseKeeper | None = None

    #: Poll interval bounds while waiting for a busy key (seconds).
    poll_min = 0.02
    poll_max = 0.5

    def run(self, attempt: Attempt, body: Callable[[int], T],
            fold: Callable[[T], BackendWrite | None] | None = None, *, deadline: float | None = None,
            ) -> RunOutcome[T]:
        """Run ``body(token)`` if and only if this attempt wins the key; a :class:`RunOutcome`.

        Args:
            attempt: Who runs, under which key.
            body: Called with the fencing token; its return value is recorded.
            fold: Builds the result backend's write from the body's result, written in the
                record's store call (:meth:`Store.record_with`); an error it raises means no fold.
            deadline: ``monotonic()`` time to stop waiting by, before the caller's time limit
                (None: none); a key freed during such a wait is not claimed.

        Raises:
            Requeue: The key is still in progress after ``config.wait`` s (or at ``deadline``),
                was freed during a wait under a ``deadline``, or an interrupt arrived first.
            StoreUnavailable: The store could not be reached at claim time (the body did not run).
            IdempotencyKeyMismatch: Same key, different payload.
            LeaseLost: The body ran but another holder took over before it was recorded.
            BaseException: Whatever the body raised, or the recorded terminal error.
        """
        try:
            claim, waited = self._settle(attempt, deadline)
        except self.interrupts as exc:
            # Nothing ran; a claim that landed just before it expires like a crash's.
            self.emit(Outcome.REQUEUED, attempt.key, 0, "", {"reason": type(exc).__name__})
            raise Requeue(attempt.key, None) from exc
        if claim.status.holds:
            return self._run_held(attempt, claim, body, fold)
        rec = claim.record
        assert rec is not None  # a DONE or FAILED claim carries its record
        self.emit(Outcome.WAITED if waited else Outcome.DUPLICATE, attempt.key, rec.token,
                  rec.task_id, {"record_state": rec.state.value})
        return RunOutcome(self.answer(rec), ran=False)

    def _settle(self, attempt: Attempt, deadline: float | None) -> tuple[Claim, bool]:
        """A claim that holds the key or carries its outcome, and whether this attempt waited."""
        cfg = self.config
        waited = False
        wait_until: float | None = None
        while True:
            claim = self.store.claim(attempt.key, owner=attempt.owner, task_id=attempt.task_id,
                                     attempt=attempt.attempt, lease=cfg.lease, ttl=cfg.ttl,
                                     payload_hash=attempt.payload_hash)
            status = claim.status
            if status.holds or status in (ClaimStatus.DONE, ClaimStatus.FAILED):
                return claim, waited
            rec = claim.record
            assert rec is not None  # every non-holding status carries the record it found
            if status is ClaimStatus.MISMATCH:
                self.emit(Outcome.MISMATCH, attempt.key, rec.token, rec.task_id, {})
                raise IdempotencyKeyMismatch(
                    f"idempotency key {attempt.key!r} was first used with different arguments "
                    f"(task {rec.task_id}); use a new key for a new action", key=attempt.key)
            if wait_until is None:  # BUSY: someone else's live lease
                wait_until = min(self.monotonic() + cfg.wait, deadline if deadline is not None else math.inf)
            seen = self.monotonic()
            holder = rec
            while True:
                found = self._wait(attempt.key, holder, claim, seen, wait_until)
                waited = True
                live = found is not None and found.state is State.IN_PROGRESS \
                    and not self._expired(found, claim, seen)
                if live and self.monotonic() >= wait_until:
                    assert found is not None
                    self.emit(Outcome.REQUEUED, attempt.key, found.token, found.task_id, {})
                    raise Requeue(attempt.key, found)
                if deadline is None or (found is not None and found.state in (State.DONE, State.FAILED)):
                    break  # done, failed, or free to take: the next claim decides atomically
                if not live:  # freed, but the wait spent part of the time limit: the next delivery claims
                    self.emit(Outcome.REQUEUED, attempt.key, holder.token, holder.task_id,
                              {"reason": "freed"})
                    raise Requeue(attempt.key, found, freed=True)
                assert found is not None  # taken over meanwhile: wait for it (as claiming would)
                holder = found

    def answer(self, rec: Record) -> Any:
        """Return a DONE record's result, or raise a FAILED record's error."""
        if rec.state is State.DONE:
            return self.codec.decode_result(rec.key, rec.content_type or "", rec.data or b"")
        raise self.codec.decode_error(rec.key, rec.content_type or "", rec.data or b"")

    # -- holding the key ---------------------------------------------------------------------

    def _run_held(self, attempt: Attempt, claim: Claim, body: Callable[[int], T],
                  fold: Callable[[T], BackendWrite | None] | None) -> RunOutcome[T]:
        key, token = attempt.key, claim.token
        fence = Fence(token, claim.claim_id)
        if claim.status is ClaimStatus.TAKEOVER:
            prev = claim.record
            self.emit(Outcome.TAKEOVER, key, token, attempt.task_id,
                      {"previous_task_id": prev.task_id if prev else "",
                       "previous_owner": prev.owner if prev else ""})
        else:
            self.emit(Outcome.CLAIMED, key, token, attempt.task_id, {})
        with (self.lease_keeper or keeper()).hold(self.store, key, fence, self.config.lease):
            try:
                result = body(token)
            except BaseException as exc:
                self._after_error(attempt, fence, exc)
                raise
            write = None
            if fold is not None:
                try:
                    write = fold(result)
                except Exception as exc:  # the record must be written whatever happens here
                    logger.debug("celery_idem backend write not folded key=%s: %r", key, exc)
            folded = self._record_result(attempt, fence, result, write)
        return RunOutcome(result, ran=True, write=write, folded=folded)

    def _after_error(self, attempt: Attempt, fence: Fence, exc: BaseException) -> None:
        cfg, key, token = self.config, attempt.key, fence.token
        if isinstance(exc, self.handover_signals):  # the replacement reports the outcome
            self._release(attempt, fence, exc, reason="handed_over")
            return
        if isinstance(exc, cfg.terminal_on):
            ctype, data = self.codec.encode_error(exc)
            try:
                written, _ = self._write(attempt, fence, State.FAILED, ctype, data)
            except LeaseLost:
                return  # reported by _write; the body's own error is what the caller sees
            if written:
                self.emit(Outcome.TERMINAL, key, token, attempt.task_id,
                          {"error": type(exc).__name__})
            return
        retried = isinstance(exc, self.retry_signals)
        if retried or isinstance(exc, cfg.release_on):
            self._release(attempt, fence, exc, retried=retried)
            return
        # Neither safe to retry nor final: the effect may have happened. Keep the claim (no
        # heartbeat) so no duplicate runs until the lease runs out.
        self.emit(Outcome.HELD, key, token, attempt.task_id,
                  {"error": type(exc).__name__, "held_for": f"{cfg.lease:g}s"})

    def _release(self, attempt: Attempt, fence: Fence, exc: BaseException, *, retried: bool = False,
                 reason: str | None = None) -> None:
        """Release the claim; a lost or unreachable claim is reported, not raised."""
        key, token = attempt.key, fence.token
        try:
            self.store.release(key, token, claim_id=fence.claim_id)
        except LeaseLost as lost:
            if retried:  # the re-published attempt took its claim over already: the hand-over works
                logger.debug("celery_idem retry took over key=%s: %s", key, lost)
            else:
                self.emit(Outcome.LEASE_LOST, key, token, attempt.task_id, {"verb": "release"})
            return
        except StoreUnavailable as down:
            logger.warning("celery_idem could not release key=%s token=%s (%s); it frees itself "
                           "when its lease expires in %.0f s", key, token, down, self.config.lease)
            return
        extra = {"error": type(getattr(exc, "exc", None) or exc).__name__}
        if reason is not None:
            extra["reason"] = reason
        self.emit(Outcome.RELEASED, key, token, attempt.task_id, extra)

    def _record_result(self, attempt: Attempt, fence: Fence, result: Any, also: BackendWrite | None) -> bool:
        """Record a body's result; return whether ``also`` was written in the same store call."""
        token = fence.token
        try:
            ctype, data = self.codec.encode_result(result)
        except Exception as exc:  # the effect happened: record a failure, so no duplicate runs it
            failure = TypeError(f"the result of {attempt.key!r} cannot be encoded: {exc}")
            logger.error("celery_idem result not encodable key=%s task_id=%s token=%s: %s; recorded "
                         "as failed so no duplicate runs the body again", attempt.key,
                         attempt.task_id, token, exc)
            err_type, err = self.codec.encode_error(failure)
            if self._write(attempt, fence, State.FAILED, err_type, err)[0]:
                self.emit(Outcome.TERMINAL, attempt.key, token, attempt.task_id,
                          {"error": "TypeError", "reason": "result_not_encodable"})
            raise
        recorded, folded = self._write(attempt, fence, State.DONE, ctype, data, also)
        if recorded:
            self.emit(Outcome.RECORDED, attempt.key, token, attempt.task_id, {})
            return folded
        # Refused for record_timeout. If a small record goes in, the result itself is refused (too
        # large): record that, so a duplicate raises instead of running.
        refused = TerminalError(f"the body of {attempt.key!r} ran (task {attempt.task_id}) but the "
                                f"store refused to record its result of {len(data)} bytes; "
                                f"duplicates get this error")
        err_type, err = self.codec.encode_error(refused)
        try:
            self.store.record(attempt.key, token, state=State.FAILED, content_type=err_type,
                              data=err, ttl=self.config.ttl, claim_id=fence.claim_id)
        except (StoreUnavailable, LeaseLost):
            return False  # a real outage: reported loudly by _write, the result goes to the caller
        self.emit(Outcome.TERMINAL, attempt.key, token, attempt.task_id,
                  {"error": "TerminalError", "reason": "result_not_recordable"})
        logger.error("celery_idem %s", refused)
        raise refused

    def _write(self, attempt: Attempt, fence: Fence, state: State, ctype: str, data: bytes,
               also: BackendWrite | None = None) -> tuple[bool, bool]:
        """Record, retrying for ``record_timeout`` (the lease is renewed meanwhile): ``(recorded,
        folded)``, recorded False when the store stayed unreachable (reported loudly), folded when
        ``also`` was written with it. Raises LeaseLost when another holder took over."""
        key, token, claim_id = attempt.key, fence.token, fence.claim_id
        deadline = self.monotonic() + self.config.record_timeout
        delay = 0.05
        while True:
            try:
                if also is None:
                    self.store.record(key, token, state=state, content_type=ctype, data=data,
                                      ttl=self.config.ttl, claim_id=claim_id)
                    return True, False
                folded = self.store.record_with(key, token, state=state, content_type=ctype,
                                                data=data, ttl=self.config.ttl, also=also, claim_id=claim_id)
                return True, bool(folded)
            except LeaseLost:
                self.emit(Outcome.LEASE_LOST, key, token, attempt.task_id, {"verb": "record"})
                raise
            except StoreUnavailable as exc:
                if self.monotonic() + delay > deadline:
                    self.emit(Outcome.RECORD_FAILED, key, token, attempt.task_id,
                              {"error": str(exc)[:200], "record_state": state.value})
                    logger.error(
                        "celery_idem RECORD FAILED key=%s task_id=%s token=%s: the body finished "
                        "but its outcome could not be recorded for %.0f s (%s). The claim stays "
                        "in progress; when its lease expires a duplicate may run the body again.",
                        key, attempt.task_id, token, self.config.record_timeout, exc)
                    return False, False
                self.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- waiting for another holder -----------------------------------------------------------

    def _expired(self, rec: Record, claim: Claim, seen: float) -> bool:
        """Whether ``rec``'s lease has run out by the store's clock (``claim.now`` at ``seen``)."""
        return rec.lease_expires is None or rec.lease_expires <= claim.now + (self.monotonic() - seen)

    def _wait(self, key: str, holder: Record, claim: Claim, seen: float, deadline: float) -> Record | None:
        """The record once ``holder``'s changes, its lease runs out, or at ``deadline`` (None: gone);
        ``claim.now`` at ``seen`` is the store's clock."""
        delay = self.poll_min
        rec: Record | None = holder
        while True:
            remaining = deadline - self.monotonic()
            if rec is None or rec.state is not State.IN_PROGRESS or rec.token != holder.token \
                    or self._expired(rec, claim, seen) or remaining <= 0:
                return rec
            self.sleep(min(delay, remaining))
            delay = min(delay * 2, self.poll_max)
            try:
                rec = self.store.get(key)
            except StoreUnavailable:
                return rec  # the next claim will raise StoreUnavailable for the task layer
