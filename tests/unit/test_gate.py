"""The gate's state machine, one test (or table) per Behaviour bullet of the contract.

Everything runs on a :class:`MemoryStore` whose clock is a fake: the gate's ``sleep`` advances it
and its ``monotonic`` reads it, so waiting, lease expiry and record retries take no real time.
Leases are held by a keeper that never renews (the fake clock alone decides expiry), except in
the heartbeat tests at the end, which use the real keeper and real time on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kombu.exceptions
import pytest
import redis.exceptions
from billiard.exceptions import SoftTimeLimitExceeded

from celery_idem.codec import KombuCodec
from celery_idem.config import DEFAULT_TERMINAL_ON, IdempotencyConfig, default_release_on
from celery_idem.events import Outcome
from celery_idem.exceptions import (
    CorruptRecord,
    IdempotencyKeyMismatch,
    LeaseLost,
    StoreUnavailable,
    TerminalError,
)
from celery_idem.gate import Attempt, Gate, Requeue
from celery_idem.lease import Lease, LeaseKeeper
from celery_idem.records import Claim, ClaimStatus, Record, State
from celery_idem.stores.base import BackendWrite, Fence, Store
from celery_idem.stores.memory import MemoryStore

KEY = "charge_card:0123456789abcdef0123456789abcdef"
START = 1_700_000_000.0
LEASE = 30.0
TTL = 3600.0
WAIT = 10.0

CONFIG = IdempotencyConfig(
    operation="charge_card",
    fields=None,
    key_func=None,
    ttl=TTL,
    lease=LEASE,
    release_on=default_release_on(),
    terminal_on=DEFAULT_TERMINAL_ON,
    validate=False,
    wait=WAIT,
    record_timeout=5.0,
)


class CardDeclined(TerminalError):
    """A terminal business outcome raised by a body."""


class PaymentRejected(Exception):
    """Not an IdempotencyError, but configured as terminal."""


class FakeRetry(Exception):
    """Stands in for celery.exceptions.Retry (the task re-published itself)."""

    def __init__(self, exc: BaseException | None = None) -> None:
        super().__init__("retry")
        self.exc = exc


# -- harness --------------------------------------------------------------------------------


class FakeClock:
    """Epoch seconds that move only when a test (or the gate's sleep) says so."""

    def __init__(self, start: float = START) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class NoRenewals(LeaseKeeper):
    """Holds leases without a heartbeat, so only the fake clock decides when they expire."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Lease] = []

    @contextmanager
    def hold(self, store: Store, key: str, fence: Fence, duration: float) -> Iterator[Lease]:
        lease = Lease(store, key, fence, duration)
        self.held.append(lease)
        try:
            yield lease
        finally:
            lease.done = True


class SpyKeeper(LeaseKeeper):
    """The real keeper, keeping a handle on each lease it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Lease] = []

    @contextmanager
    def hold(self, store: Store, key: str, fence: Fence, duration: float) -> Iterator[Lease]:
        with super().hold(store, key, fence, duration) as lease:
            self.held.append(lease)
            yield lease


class FlakyStore(Store):
    """A MemoryStore behind a switch: each verb can be made to raise StoreUnavailable.

    ``down`` holds verbs that fail on every call; ``fail_next[verb]`` counts calls that fail
    before the verb works again; a verb in ``lose_reply`` performs the write and *then* raises
    (the reply was lost on the way back).
    """

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__()
        self.inner = inner
        self.down: set[str] = set()
        self.fail_next: dict[str, int] = {}
        self.lose_reply: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "celery-idem:", **options: Any) -> FlakyStore:
        raise NotImplementedError

    def _gate(self, verb: str) -> None:
        self.calls[verb] = self.calls.get(verb, 0) + 1
        if verb in self.down:
            raise StoreUnavailable(f"{verb}: connection refused")
        if self.fail_next.get(verb, 0) > 0:
            self.fail_next[verb] -= 1
            raise StoreUnavailable(f"{verb}: timed out")

    def claim(self, key: str, **kwargs: Any) -> Claim:
        self._gate("claim")
        return self.inner.claim(key, **kwargs)

    def record(self, key: str, token: int, **kwargs: Any) -> None:
        self._gate("record")
        self.inner.record(key, token, **kwargs)
        if self.lose_reply.get("record", 0) > 0:
            self.lose_reply["record"] -= 1
            raise StoreUnavailable("record: reply lost")

    def release(self, key: str, token: int, **kwargs: Any) -> None:
        self._gate("release")
        self.inner.release(key, token, **kwargs)

    def renew(self, key: str, token: int, lease: float, **kwargs: Any) -> float:
        self._gate("renew")
        return self.inner.renew(key, token, lease, **kwargs)

    def get(self, key: str) -> Record | None:
        self._gate("get")
        return self.inner.get(key)

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        return self.inner.scan(state, count)

    def now(self) -> float:
        return self.inner.now()


class Body:
    """A task body that counts its runs, remembers its tokens, and may act or raise."""

    def __init__(
        self,
        result: Any = "ok",
        raises: BaseException | None = None,
        during: Callable[[int], Any] | None = None,
    ) -> None:
        self.result = result
        self.raises = raises
        self.during = during
        self.tokens: list[int] = []

    @property
    def runs(self) -> int:
        return len(self.tokens)

    def __call__(self, token: int) -> Any:
        self.tokens.append(token)
        if self.during is not None:
            self.during(token)
        if self.raises is not None:
            raise self.raises
        return self.result


Event = tuple[Outcome, str, int, str]


class IssuingMemory(MemoryStore):
    """The memory store, keeping every token its taking claims issued, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.issued: list[int] = []
        self.clock_stepped_back = False  # a test that makes the store repeat a token says so

    def claim(self, key: str, **kwargs: Any) -> Claim:
        result = super().claim(key, **kwargs)
        if result.status.holds:
            # The contract: each token of a key is above every earlier one.
            assert not self.issued or result.token > self.issued[-1] or self.clock_stepped_back, (
                self.issued, result.token)
            self.issued.append(result.token)
        return result


class World:
    """One fake clock, one store, one event log, and gates that share them.

    Tokens are the store clock in µs, or the previous token + 1 (see celery_idem.stores.base):
    the tests name them by the order of the claims that took them, ``T(1)`` for the first
    taking claim's token, ``T(2)`` for the second, and so on (``ordinal`` is the inverse). The
    events hold those ordinals; ``IssuingMemory`` checks that each one is above the previous.
    """

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.memory = IssuingMemory(prefix="unit:", clock=self.clock)
        self.store: Store = self.memory
        self.codec = KombuCodec("json", ["json"])
        self.events: list[Event] = []
        self.extras: list[dict[str, Any]] = []
        self.keeper = NoRenewals()

    def T(self, n: int) -> int:
        """The token of the ``n``-th taking claim (1-based)."""
        return self.memory.issued[n - 1]

    def ordinal(self, token: int) -> int:
        """Which taking claim issued ``token`` (1-based); the token itself if none did."""
        return self.memory.issued.index(token) + 1 if token in self.memory.issued else token

    def ordinals(self, tokens: list[int]) -> list[int]:
        return [self.ordinal(token) for token in tokens]

    def emit(self, outcome: Outcome, key: str, token: int, original: str,
             extra: dict[str, Any]) -> None:
        self.events.append((outcome, key, self.ordinal(token), original))
        self.extras.append(dict(extra))

    def gate(self, **overrides: Any) -> Gate:
        retry_signals = overrides.pop("retry_signals", ())
        handover_signals = overrides.pop("handover_signals", ())
        interrupts = overrides.pop("interrupts", ())
        keeper = overrides.pop("lease_keeper", self.keeper)
        return Gate(
            self.store,
            dataclasses.replace(CONFIG, **overrides),
            self.codec,
            emit=self.emit,
            retry_signals=retry_signals,
            handover_signals=handover_signals,
            interrupts=interrupts,
            sleep=self.clock.sleep,
            monotonic=self.clock,
            lease_keeper=keeper,
        )

    def hold_elsewhere(self, task_id: str = "t-holder", attempt: int = 0,
                       lease: float = LEASE) -> Claim:
        """Another worker claims KEY (and is then busy running its body)."""
        claim = self.memory.claim(KEY, owner="other:1", task_id=task_id, attempt=attempt,
                                  lease=lease, ttl=TTL)
        assert claim.status is ClaimStatus.CLAIMED
        return claim

    def finish_elsewhere(self, token: int, value: Any) -> None:
        ctype, data = self.codec.encode_result(value)
        self.memory.record(KEY, token, state=State.DONE, content_type=ctype, data=data, ttl=TTL)

    def fail_elsewhere(self, token: int, exc: BaseException) -> None:
        ctype, data = self.codec.encode_error(exc)
        self.memory.record(KEY, token, state=State.FAILED, content_type=ctype, data=data, ttl=TTL)

    def record(self) -> Record:
        rec = self.memory.get(KEY)
        assert rec is not None
        return rec

    def result_of(self, rec: Record) -> Any:
        assert rec.state is State.DONE
        return self.codec.decode_result(KEY, rec.content_type or "", rec.data or b"")


@pytest.fixture
def world() -> World:
    return World()


def attempt(task_id: str = "t1", retries: int = 0, payload_hash: str | None = None) -> Attempt:
    return Attempt(key=KEY, task_id=task_id, attempt=retries, owner="me:1",
                   payload_hash=payload_hash)


# -- first attempt ----------------------------------------------------------------------------


def test_a_first_attempt_claims_runs_the_body_once_and_records_its_result(world: World) -> None:
    body = Body(result={"charge": "ch_1", "amount": 4200})

    result = world.gate().run(attempt("t1"), body).value

    assert result == {"charge": "ch_1", "amount": 4200}
    assert world.ordinals(body.tokens) == [1]
    assert world.events == [(Outcome.CLAIMED, KEY, 1, "t1"), (Outcome.RECORDED, KEY, 1, "t1")]
    rec = world.record()
    assert (rec.state, world.ordinal(rec.token), rec.task_id, rec.owner) == (State.DONE, 1, "t1", "me:1")
    assert rec.lease_expires is None
    assert world.result_of(rec) == result


class FoldingMemory(IssuingMemory):
    """A memory store that folds the backend write into the record (as one Redis server does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.folded: list[BackendWrite] = []

    def record_with(self, key: str, token: int, *, also: BackendWrite, **kwargs: Any) -> bool:
        self.record(key, token, **kwargs)
        self.folded.append(also)
        return True


def test_the_outcome_says_the_body_ran_and_no_write_was_folded_without_a_fold(world: World) -> None:
    outcome = world.gate().run(attempt("t1"), Body(result="ran"))

    assert (outcome.value, outcome.ran, outcome.write, outcome.folded) == ("ran", True, None, False)


def test_the_outcome_of_a_duplicate_says_it_was_answered_from_the_record(world: World) -> None:
    world.gate().run(attempt("t1"), Body(result="first"))
    duplicate = Body(result="second")

    outcome = world.gate().run(attempt("t2"), duplicate, lambda result: BackendWrite("k", b"m"))

    assert (outcome.value, outcome.ran, outcome.write, outcome.folded) == ("first", False, None, False)
    assert duplicate.tokens == []


def test_the_outcome_carries_the_write_built_for_the_record_and_whether_it_rode_on_it(
    world: World,
) -> None:
    # A store that cannot fold: the write is built and handed back for the caller to make
    plain = world.gate().run(attempt("t1"), Body(result="v"), lambda result: BackendWrite("k", result))
    assert (plain.write, plain.folded) == (BackendWrite("k", "v"), False)
    # One that can: the same write goes into the record's own store call
    world.memory = world.store = FoldingMemory(prefix="unit:", clock=world.clock)  # type: ignore[assignment]
    folded = world.gate().run(attempt("t2"), Body(result="w"), lambda result: BackendWrite("k", result))
    assert (folded.write, folded.folded) == (BackendWrite("k", "w"), True)
    assert world.memory.folded == [BackendWrite("k", "w")]  # type: ignore[attr-defined]


def test_a_fold_that_fails_only_means_no_fold(world: World) -> None:
    def broken(result: Any) -> BackendWrite:
        raise ValueError("no meta")

    outcome = world.gate().run(attempt("t1"), Body(result="v"), broken)

    assert (outcome.value, outcome.ran, outcome.write, outcome.folded) == ("v", True, None, False)
    assert world.record().state is State.DONE


def test_the_lease_is_held_for_exactly_the_body_and_the_record(world: World) -> None:
    seen: list[bool] = []
    body = Body(during=lambda token: seen.append(world.keeper.held[-1].done))

    world.gate().run(attempt(), body)

    assert seen == [False]  # held while the body runs
    assert [(lease.key, lease.token, lease.duration, lease.done)
            for lease in world.keeper.held] == [(KEY, world.T(1), LEASE, True)]


# -- duplicates of a done key -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_id", "retries"),
    [
        pytest.param("t1", 0, id="redelivery of the same message"),
        pytest.param("t1", 1, id="autoretry of the finished action"),
        pytest.param("t2", 0, id="second enqueue"),
    ],
)
def test_a_duplicate_of_a_done_key_returns_the_cached_result_without_running(
    world: World, task_id: str, retries: int
) -> None:
    # Given the action already ran and was recorded
    world.gate().run(attempt("t1"), Body(result=[1, "two"]))
    world.events.clear()
    # When a duplicate arrives
    duplicate = Body(result="must not be returned")
    result = world.gate().run(attempt(task_id, retries), duplicate).value
    # Then it gets the recorded result, and the body did not run
    assert result == [1, "two"]
    assert duplicate.runs == 0
    assert world.events == [(Outcome.DUPLICATE, KEY, 1, "t1")]
    assert world.ordinal(world.record().token) == 1


def test_a_duplicate_of_a_record_in_a_refused_format_raises_corrupt_record(world: World) -> None:
    # Given a record written with pickle, and an app that accepts only json
    world.hold_elsewhere()
    world.memory.record(KEY, world.T(1), state=State.DONE, content_type="application/x-python-serialize",
                        data=b"\x80\x04K\x01.", ttl=TTL)
    duplicate = Body()
    # Then it is refused, never unpickled, and the body does not run either
    with pytest.raises(CorruptRecord, match="does not accept"):
        world.gate().run(attempt("t2"), duplicate)
    assert duplicate.runs == 0


# -- in-progress duplicates -------------------------------------------------------------------


def test_a_duplicate_of_a_key_in_progress_waits_and_gets_the_holders_result(
    world: World,
) -> None:
    # Given another worker holds the key
    world.hold_elsewhere("t-holder")
    # And it records its result while the duplicate is waiting
    polls = 0

    def sleep(seconds: float) -> None:
        nonlocal polls
        polls += 1
        world.clock.sleep(seconds)
        if polls == 3:
            world.finish_elsewhere(world.T(1), {"charge": "ch_holder"})

    gate = world.gate()
    gate.sleep = sleep
    duplicate = Body()
    # When the duplicate runs through the gate
    result = gate.run(attempt("t2"), duplicate).value
    # Then it returns the holder's result without running the body
    assert result == {"charge": "ch_holder"}
    assert duplicate.runs == 0
    assert world.events == [(Outcome.WAITED, KEY, 1, "t-holder")]
    assert world.clock.now - START < WAIT


def test_a_waiting_duplicate_re_raises_the_holders_terminal_error(world: World) -> None:
    world.hold_elsewhere("t-holder")
    gate = world.gate()
    gate.sleep = lambda s: (world.clock.sleep(s), world.fail_elsewhere(world.T(1), CardDeclined("no")))
    duplicate = Body()

    with pytest.raises(CardDeclined, match=r"^no$"):
        gate.run(attempt("t2"), duplicate)

    assert duplicate.runs == 0
    assert world.events == [(Outcome.WAITED, KEY, 1, "t-holder")]


def test_a_waiting_duplicate_claims_and_runs_when_the_holder_releases(world: World) -> None:
    world.hold_elsewhere("t-holder")
    gate = world.gate()
    gate.sleep = lambda s: (world.clock.sleep(s), world.memory.release(KEY, world.T(1)))
    duplicate = Body(result="mine")

    assert gate.run(attempt("t2"), duplicate).value == "mine"

    assert world.ordinals(duplicate.tokens) == [2]
    assert world.events == [(Outcome.CLAIMED, KEY, 2, "t2"), (Outcome.RECORDED, KEY, 2, "t2")]


def test_a_duplicate_still_busy_after_the_wait_raises_requeue_without_running(
    world: World,
) -> None:
    # Given another worker holds the key for longer than the duplicate will wait
    world.hold_elsewhere("t-holder")
    duplicate = Body()
    # When the duplicate runs through the gate
    with pytest.raises(Requeue) as info:
        world.gate().run(attempt("t2"), duplicate)
    # Then it gave up after about `wait` seconds, and the body did not run
    assert WAIT <= world.clock.now - START < LEASE
    assert duplicate.runs == 0
    assert info.value.key == KEY
    assert info.value.holder is not None and info.value.holder.task_id == "t-holder"
    assert world.events == [(Outcome.REQUEUED, KEY, 1, "t-holder")]
    # And the holder's claim is untouched
    rec = world.record()
    assert (rec.state, world.ordinal(rec.token), rec.task_id) == (State.IN_PROGRESS, 1, "t-holder")


def test_a_duplicate_with_zero_wait_requeues_at_once(world: World) -> None:
    world.hold_elsewhere()
    with pytest.raises(Requeue):
        world.gate(wait=0).run(attempt("t2"), Body())
    assert world.clock.now == START


def test_polling_backs_off_and_never_sleeps_past_the_deadline(world: World) -> None:
    world.hold_elsewhere()
    with pytest.raises(Requeue):
        world.gate().run(attempt("t2"), Body())
    sleeps = world.clock.sleeps
    assert sleeps[0] == Gate.poll_min
    assert max(sleeps) <= Gate.poll_max
    assert sleeps == sorted(sleeps[:-1]) + sleeps[-1:]  # non-decreasing until the last, clipped one
    assert sum(sleeps) == pytest.approx(WAIT)


def test_a_duplicate_waiting_past_the_holders_lease_takes_over(world: World) -> None:
    # Given a holder whose lease runs out 5 s into the duplicate's 10 s wait
    world.hold_elsewhere("t-holder")
    world.clock.advance(LEASE - 5)
    duplicate = Body(result="taken over")
    # When the duplicate waits
    assert world.gate().run(attempt("t2"), duplicate).value == "taken over"
    # Then it took over with token + 1 as soon as the lease expired
    assert world.ordinals(duplicate.tokens) == [2]
    assert world.clock.now - START == pytest.approx(LEASE, abs=Gate.poll_max)
    assert world.events[0] == (Outcome.TAKEOVER, KEY, 2, "t2")


# -- a deadline (the caller's time limit) and interrupts ------------------------------------------


def test_a_deadline_shorter_than_the_wait_ends_the_wait_there_with_requeue(world: World) -> None:
    # Given a holder with a long lease, and a duplicate whose time limit leaves it 2 s to wait
    world.hold_elsewhere("t-holder")
    duplicate = Body()
    # When it runs through the gate (wait 10 s, deadline in 2 s)
    with pytest.raises(Requeue) as info:
        world.gate().run(attempt("t2"), duplicate, deadline=START + 2)
    # Then it gave up at the deadline, not after `wait`, and did not run
    assert world.clock.now - START == pytest.approx(2)
    assert duplicate.runs == 0
    assert info.value.freed is False
    assert world.events == [(Outcome.REQUEUED, KEY, 1, "t-holder")]


def test_a_deadline_already_past_requeues_a_busy_key_without_sleeping(world: World) -> None:
    world.hold_elsewhere()
    with pytest.raises(Requeue):
        world.gate().run(attempt("t2"), Body(), deadline=START - 1)
    assert world.clock.sleeps == []


def test_under_a_deadline_a_key_freed_during_the_wait_is_left_for_the_next_delivery(
    world: World,
) -> None:
    # Given a holder whose lease runs out 1 s into the duplicate's wait
    world.hold_elsewhere("t-holder")
    world.clock.advance(LEASE - 1)
    duplicate = Body()
    # When the duplicate, 2 s from its deadline, sees the lease run out
    with pytest.raises(Requeue) as info:
        world.gate().run(attempt("t2"), duplicate, deadline=world.clock.now + 2)
    # Then it does not claim (its body would start with 1 s of its limit left): it re-queues,
    # saying the key is free
    assert duplicate.runs == 0
    assert info.value.freed is True
    assert world.events == [(Outcome.REQUEUED, KEY, 1, "t-holder")]
    assert world.extras == [{"reason": "freed"}]
    assert world.ordinal(world.record().token) == 1
    # And the next delivery, with its whole limit ahead, takes over at once
    retaken = Body(result="next")
    assert world.gate().run(attempt("t2"), retaken, deadline=world.clock.now + 2).value == "next"
    assert world.ordinals(retaken.tokens) == [2]


def test_under_a_deadline_a_key_done_during_the_wait_is_answered(world: World) -> None:
    held = world.hold_elsewhere("t-holder")
    gate = world.gate()
    gate.sleep = lambda s: (world.clock.sleep(s), world.finish_elsewhere(held.token, "theirs"))
    duplicate = Body()

    assert gate.run(attempt("t2"), duplicate, deadline=START + 5).value == "theirs"

    assert duplicate.runs == 0
    assert world.events == [(Outcome.WAITED, KEY, 1, "t-holder")]


def test_under_a_deadline_a_takeover_during_the_wait_is_waited_on_not_claimed(world: World) -> None:
    # Given a holder that is taken over by a third attempt while the duplicate waits
    held = world.hold_elsewhere("t-holder", lease=1)
    claims: list[str] = []
    store = FlakyStore(world.memory)
    world.store = store
    gate = world.gate()

    def sleep(seconds: float) -> None:
        world.clock.sleep(seconds)
        if world.record().token == held.token and world.clock.now - START > 1:
            world.memory.claim(KEY, owner="third:1", task_id="t3", attempt=0, lease=LEASE, ttl=TTL)

    gate.sleep = sleep
    duplicate = Body()
    # When the duplicate waits until its deadline
    with pytest.raises(Requeue) as info:
        gate.run(attempt("t2"), duplicate, deadline=START + 3)
    claims.append(str(store.calls.get("claim")))
    # Then it claimed once (at the start) and waited on the new holder until its deadline
    assert claims == ["1"]
    assert duplicate.runs == 0
    assert info.value.holder is not None and info.value.holder.task_id == "t3"
    assert world.clock.now - START == pytest.approx(3)


def test_an_interrupt_while_waiting_becomes_requeue_and_leaves_the_holder_alone(
    world: World,
) -> None:
    # Given a duplicate waiting for a live holder
    world.hold_elsewhere("t-holder")
    gate = world.gate(interrupts=(SoftTimeLimitExceeded,))

    def sleep(seconds: float) -> None:
        world.clock.sleep(seconds)
        if world.clock.now - START > 1:
            raise SoftTimeLimitExceeded()  # its own soft time limit fires

    gate.sleep = sleep
    duplicate = Body()
    # When its soft time limit fires during the wait
    with pytest.raises(Requeue) as info:
        gate.run(attempt("t2"), duplicate)
    # Then it re-queues instead of failing, without running, and the holder keeps its claim
    assert isinstance(info.value.__cause__, SoftTimeLimitExceeded)
    assert duplicate.runs == 0
    assert world.events == [(Outcome.REQUEUED, KEY, 0, "")]
    assert world.extras == [{"reason": "SoftTimeLimitExceeded"}]
    assert (world.record().state, world.record().task_id) == (State.IN_PROGRESS, "t-holder")


def test_an_interrupt_raised_by_the_body_is_the_bodys_error_not_a_requeue(world: World) -> None:
    body = Body(raises=SoftTimeLimitExceeded())

    with pytest.raises(SoftTimeLimitExceeded):
        world.gate(interrupts=(SoftTimeLimitExceeded,)).run(attempt(), body, deadline=START + 5)

    assert body.runs == 1
    assert world.record().state is State.RELEASED  # timeout-class: given back for a retry
    assert world.events[-1][0] is Outcome.RELEASED


def test_under_a_deadline_a_key_released_during_the_wait_is_left_for_the_next_delivery(
    world: World,
) -> None:
    held = world.hold_elsewhere("t-holder")
    gate = world.gate()
    gate.sleep = lambda s: (world.clock.sleep(s), world.memory.release(KEY, held.token))
    duplicate = Body()

    with pytest.raises(Requeue) as info:
        gate.run(attempt("t2"), duplicate, deadline=START + 5)

    assert info.value.freed is True
    assert duplicate.runs == 0
    assert world.record().state is State.RELEASED


# -- lease expiry and takeover ----------------------------------------------------------------


def test_an_expired_lease_is_taken_over_at_once_with_token_plus_one(world: World) -> None:
    world.hold_elsewhere("t-crashed")
    world.clock.advance(LEASE + 1)
    survivor = Body(result="second")

    assert world.gate().run(attempt("t2"), survivor).value == "second"

    assert world.ordinals(survivor.tokens) == [2]
    assert world.clock.sleeps == []
    assert world.events == [(Outcome.TAKEOVER, KEY, 2, "t2"), (Outcome.RECORDED, KEY, 2, "t2")]
    assert world.extras[0]["previous_task_id"] == "t-crashed"
    assert world.extras[0]["previous_owner"] == "other:1"


def test_a_lease_is_live_until_the_instant_it_expires(world: World) -> None:
    world.hold_elsewhere()
    world.clock.advance(LEASE - 0.001)
    with pytest.raises(Requeue):
        world.gate(wait=0).run(attempt("t2"), Body())
    world.clock.advance(0.001)
    assert world.gate(wait=0).run(attempt("t2"), Body(result="now")).value == "now"


def test_the_stale_holders_record_is_refused_with_lease_lost(world: World) -> None:
    # Given holder t1 stalls past its lease, and a redelivery t2 takes over and records
    takeover = Body(result="from t2")

    def stall(token: int) -> None:
        world.clock.advance(LEASE + 1)
        assert world.gate().run(attempt("t2"), takeover).value == "from t2"

    stale = Body(result="from t1", during=stall)
    # When t1's body finally returns
    with pytest.raises(LeaseLost) as info:
        world.gate().run(attempt("t1"), stale)
    # Then its record is refused and the new holder's result stands
    assert (info.value.key, world.ordinal(info.value.token or 0)) == (KEY, 1)
    assert (world.ordinals(stale.tokens), world.ordinals(takeover.tokens)) == ([1], [2])
    assert world.events == [
        (Outcome.CLAIMED, KEY, 1, "t1"),
        (Outcome.TAKEOVER, KEY, 2, "t2"),
        (Outcome.RECORDED, KEY, 2, "t2"),
        (Outcome.LEASE_LOST, KEY, 1, "t1"),
    ]
    rec = world.record()
    assert (world.ordinal(rec.token), world.result_of(rec)) == (2, "from t2")


def test_a_stale_holders_release_is_refused_and_reported(world: World) -> None:
    def stall(token: int) -> None:
        world.clock.advance(LEASE + 1)
        world.gate().run(attempt("t2"), Body(result="from t2"))

    with pytest.raises(TimeoutError):
        world.gate().run(attempt("t1"), Body(raises=TimeoutError("slow"), during=stall))

    assert world.events[-1] == (Outcome.LEASE_LOST, KEY, 1, "t1")
    assert world.result_of(world.record()) == "from t2"


def test_a_stale_holders_terminal_error_does_not_overwrite_the_new_holder(world: World) -> None:
    def stall(token: int) -> None:
        world.clock.advance(LEASE + 1)
        world.gate().run(attempt("t2"), Body(result="from t2"))

    # The stale holder's own error reaches its caller (the lost lease is reported as an event);
    # its record is refused, so the new holder's result stands.
    with pytest.raises(CardDeclined, match="late"):
        world.gate().run(attempt("t1"), Body(raises=CardDeclined("late"), during=stall))

    assert world.result_of(world.record()) == "from t2"
    assert (Outcome.LEASE_LOST, KEY, 1, "t1") in world.events


# -- retries of the same task id --------------------------------------------------------------


def test_a_retry_of_the_same_task_id_takes_its_claim_over_at_once(world: World) -> None:
    # Given attempt 0 of t1 holds a live lease (it published its retry and is ending)
    world.hold_elsewhere("t1", attempt=0)
    retry = Body(result="retried")
    # When attempt 1 of the same task id arrives
    assert world.gate().run(attempt("t1", retries=1), retry).value == "retried"
    # Then it took over without waiting
    assert world.ordinals(retry.tokens) == [2]
    assert world.clock.sleeps == []
    assert world.events[0] == (Outcome.TAKEOVER, KEY, 2, "t1")


@pytest.mark.parametrize(
    ("task_id", "retries"),
    [
        pytest.param("t1", 0, id="same task id, same attempt (redelivered while running)"),
        pytest.param("t2", 5, id="other task id, higher attempt"),
    ],
)
def test_only_a_later_attempt_of_the_same_task_id_skips_the_live_lease(
    world: World, task_id: str, retries: int
) -> None:
    world.hold_elsewhere("t1", attempt=0)
    body = Body()
    with pytest.raises(Requeue):
        world.gate(wait=0).run(attempt(task_id, retries), body)
    assert body.runs == 0


def test_a_retry_signal_releases_the_claim_for_the_published_retry(world: World) -> None:
    # Given a body that asks Celery for a retry (which re-publishes, then raises Retry)
    signal = FakeRetry(exc=TimeoutError("upstream"))
    with pytest.raises(FakeRetry):
        world.gate(retry_signals=(FakeRetry,), release_on=()).run(
            attempt("t1"), Body(raises=signal)
        )
    # Then the claim is released, so the retry (attempt 1) claims with token + 1
    assert world.record().state is State.RELEASED
    assert world.events[-1] == (Outcome.RELEASED, KEY, 1, "t1")
    assert world.extras[-1]["error"] == "TimeoutError"
    retry = Body(result="second try")
    assert world.gate().run(attempt("t1", retries=1), retry).value == "second try"
    assert world.ordinals(retry.tokens) == [2]


def test_a_retry_signal_after_the_retry_took_over_is_a_hand_over_not_a_lost_lease(
    world: World,
) -> None:
    # Given the published retry (attempt 1) is consumed and claims before attempt 0 has ended
    retry = Body(result="from the retry")

    def publish_retry(token: int) -> None:
        assert world.gate().run(attempt("t1", retries=1), retry).value == "from the retry"

    first = Body(raises=FakeRetry(), during=publish_retry)
    # When attempt 0 raises the retry signal
    with pytest.raises(FakeRetry):
        world.gate(retry_signals=(FakeRetry,)).run(attempt("t1"), first)
    # Then the refused release is not reported as a lost lease, and the retry's result stands
    assert Outcome.LEASE_LOST not in [event[0] for event in world.events]
    assert (world.ordinals(first.tokens), world.ordinals(retry.tokens)) == ([1], [2])
    assert world.result_of(world.record()) == "from the retry"


class FakeReplaced(Exception):
    """Stands in for Celery's Ignore raised by Task.replace (the gate is Celery-free)."""


def test_a_handover_signal_releases_the_claim_and_records_nothing(world: World) -> None:
    # Given a body that hands its action to a replacement (Task.replace raises Ignore), with
    # the exception also in terminal_on: the hand-over wins, nothing is recorded
    with pytest.raises(FakeReplaced):
        world.gate(handover_signals=(FakeReplaced,), terminal_on=(FakeReplaced,)).run(
            attempt("t1"), Body(raises=FakeReplaced("replaced"))
        )
    # Then the claim is released at once (no hold for the lease) and no outcome is recorded
    assert world.record().state is State.RELEASED
    assert world.events[-1] == (Outcome.RELEASED, KEY, 1, "t1")
    assert world.extras[-1] == {"error": "FakeReplaced", "reason": "handed_over"}
    # And a duplicate does not wait: it claims with token + 1 and runs
    again = Body(result="again")
    assert world.gate(wait=0).run(attempt("t2"), again).value == "again"
    assert world.ordinals(again.tokens) == [2]


def test_without_a_handover_signal_the_same_error_holds_the_claim(world: World) -> None:
    with pytest.raises(FakeReplaced):
        world.gate().run(attempt("t1"), Body(raises=FakeReplaced("replaced")))
    assert world.record().state is State.IN_PROGRESS
    assert world.events[-1][0] is Outcome.HELD


# -- errors raised by the body ----------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(TimeoutError("read timed out"), id="TimeoutError"),
        pytest.param(ConnectionError("reset by peer"), id="ConnectionError"),
        pytest.param(SoftTimeLimitExceeded(), id="SoftTimeLimitExceeded"),
        pytest.param(redis.exceptions.ConnectionError("down"), id="redis ConnectionError"),
        pytest.param(redis.exceptions.TimeoutError("slow"), id="redis TimeoutError"),
        pytest.param(kombu.exceptions.OperationalError("broker"), id="kombu OperationalError"),
    ],
)
def test_a_timeout_class_error_releases_the_claim_and_the_next_attempt_runs(
    world: World, error: BaseException
) -> None:
    # Given a body that fails with a timeout-class error
    with pytest.raises(type(error)) as info:
        world.gate().run(attempt("t1"), Body(raises=error))
    # Then the error propagates unchanged and the claim is released
    assert info.value is error
    assert world.events == [(Outcome.CLAIMED, KEY, 1, "t1"), (Outcome.RELEASED, KEY, 1, "t1")]
    rec = world.record()
    assert (rec.state, world.ordinal(rec.token)) == (State.RELEASED, 1)
    # And the next attempt claims with token + 1 and runs at once
    retry = Body(result="second")
    assert world.gate().run(attempt("t1", retries=1), retry).value == "second"
    assert world.ordinals(retry.tokens) == [2]
    assert world.clock.sleeps == []
    assert world.events[-2:] == [(Outcome.CLAIMED, KEY, 2, "t1"), (Outcome.RECORDED, KEY, 2, "t1")]


def test_a_release_that_cannot_reach_the_store_leaves_the_lease_to_expire(world: World) -> None:
    flaky = FlakyStore(world.memory)
    flaky.down.add("release")
    world.store = flaky

    with pytest.raises(TimeoutError):
        world.gate().run(attempt("t1"), Body(raises=TimeoutError()))

    assert world.record().state is State.IN_PROGRESS
    assert [event[0] for event in world.events] == [Outcome.CLAIMED]
    world.clock.advance(LEASE)
    retry = Body(result="after expiry")
    assert world.gate().run(attempt("t1", retries=1), retry).value == "after expiry"
    assert world.ordinals(retry.tokens) == [2]


@pytest.mark.parametrize(
    ("error", "terminal_on"),
    [
        pytest.param(TerminalError("card declined"), DEFAULT_TERMINAL_ON, id="TerminalError"),
        pytest.param(CardDeclined("insufficient funds: 42.00 EUR"), DEFAULT_TERMINAL_ON,
                     id="TerminalError subclass"),
        pytest.param(PaymentRejected("iban invalid"), (PaymentRejected,),
                     id="configured terminal_on"),
    ],
)
def test_a_terminal_error_is_recorded_and_duplicates_re_raise_it_without_running(
    world: World, error: BaseException, terminal_on: tuple[type[BaseException], ...]
) -> None:
    # Given the body fails with a terminal error
    with pytest.raises(type(error)) as info:
        world.gate(terminal_on=terminal_on).run(attempt("t1"), Body(raises=error))
    assert info.value is error
    # Then the failure is the recorded outcome
    assert world.events == [(Outcome.CLAIMED, KEY, 1, "t1"), (Outcome.TERMINAL, KEY, 1, "t1")]
    assert world.record().state is State.FAILED
    # And every duplicate re-raises the same type and message without running
    for task_id, retries in (("t1", 1), ("t2", 0)):
        duplicate = Body()
        with pytest.raises(type(error)) as again:
            world.gate(terminal_on=terminal_on).run(attempt(task_id, retries), duplicate)
        assert type(again.value) is type(error)
        assert str(again.value) == str(error)
        assert duplicate.runs == 0
    assert world.events[-1] == (Outcome.DUPLICATE, KEY, 1, "t1")


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(ValueError("bad amount"), id="ValueError"),
        pytest.param(KeyError("sku"), id="KeyError"),
        pytest.param(RuntimeError("provider said 500"), id="RuntimeError"),
    ],
)
def test_an_unclassified_error_holds_the_claim_until_its_lease_expires(
    world: World, error: BaseException
) -> None:
    # Given the body fails with an error that is neither terminal nor timeout-class
    with pytest.raises(type(error)):
        world.gate().run(attempt("t1"), Body(raises=error))
    # Then the claim is kept (the effect may have happened)
    assert world.events == [(Outcome.CLAIMED, KEY, 1, "t1"), (Outcome.HELD, KEY, 1, "t1")]
    rec = world.record()
    assert (rec.state, world.ordinal(rec.token), rec.lease_expires) == (State.IN_PROGRESS, 1, START + LEASE)
    # And a duplicate before expiry finds it busy and does not run
    early = Body()
    world.clock.advance(LEASE - 1)
    with pytest.raises(Requeue):
        world.gate(wait=0).run(attempt("t2"), early)
    assert early.runs == 0
    # And after expiry it takes over with token + 1
    world.clock.advance(1)
    late = Body(result="after the hold")
    assert world.gate().run(attempt("t2"), late).value == "after the hold"
    assert world.ordinals(late.tokens) == [2]
    assert (Outcome.TAKEOVER, KEY, 2, "t2") in world.events


# -- payload validation -----------------------------------------------------------------------


def test_the_same_key_with_a_different_payload_raises_mismatch_without_running(
    world: World,
) -> None:
    world.gate(validate=True).run(attempt("t1", payload_hash="hash-a"), Body(result="a"))
    other = Body()

    with pytest.raises(IdempotencyKeyMismatch) as info:
        world.gate(validate=True).run(attempt("t2", payload_hash="hash-b"), other)

    assert info.value.key == KEY
    assert "t1" in str(info.value)
    assert other.runs == 0
    assert world.events[-1] == (Outcome.MISMATCH, KEY, 1, "t1")
    assert world.result_of(world.record()) == "a"


def test_the_same_key_with_the_same_payload_is_a_plain_duplicate(world: World) -> None:
    world.gate(validate=True).run(attempt("t1", payload_hash="hash-a"), Body(result="a"))
    again = Body()
    assert world.gate(validate=True).run(attempt("t2", payload_hash="hash-a"), again).value == "a"
    assert again.runs == 0
    assert world.events[-1][0] is Outcome.DUPLICATE


def test_a_different_payload_for_a_key_in_progress_is_a_mismatch_not_a_wait(world: World) -> None:
    world.memory.claim(KEY, owner="o", task_id="t1", attempt=0, lease=LEASE, ttl=TTL,
                       payload_hash="hash-a")
    with pytest.raises(IdempotencyKeyMismatch):
        world.gate(validate=True).run(attempt("t2", payload_hash="hash-b"), Body())
    assert world.clock.sleeps == []


# -- the store failing ------------------------------------------------------------------------


def test_a_store_unreachable_at_claim_raises_store_unavailable_and_the_body_does_not_run(
    world: World,
) -> None:
    flaky = FlakyStore(world.memory)
    flaky.down.add("claim")
    world.store = flaky
    body = Body()

    with pytest.raises(StoreUnavailable):
        world.gate().run(attempt(), body)

    assert body.runs == 0
    assert world.events == []
    assert world.memory.get(KEY) is None


def test_a_store_lost_while_waiting_raises_store_unavailable_and_the_body_does_not_run(
    world: World,
) -> None:
    # Given another worker holds the key, and the store goes down during the wait
    world.hold_elsewhere()
    flaky = FlakyStore(world.memory)
    world.store = flaky
    gate = world.gate()
    gate.sleep = lambda s: (world.clock.sleep(s), flaky.down.update({"get", "claim"}))
    body = Body()

    with pytest.raises(StoreUnavailable):
        gate.run(attempt("t2"), body)

    assert body.runs == 0


def test_a_record_that_keeps_failing_returns_the_result_and_keeps_the_claim(
    world: World,
) -> None:
    # Given the store stops answering writes after the claim
    flaky = FlakyStore(world.memory)
    flaky.down.add("record")
    world.store = flaky
    body = Body(result={"charge": "ch_1"})
    # When the body succeeds
    result = world.gate(record_timeout=5.0).run(attempt("t1"), body).value
    # Then the caller still gets the result (the effect happened)
    assert result == {"charge": "ch_1"}
    assert body.runs == 1
    # And the record was retried for record_timeout, then reported loudly
    assert flaky.calls["record"] > 1
    assert sum(world.clock.sleeps) <= 5.0
    assert world.events == [
        (Outcome.CLAIMED, KEY, 1, "t1"),
        (Outcome.RECORD_FAILED, KEY, 1, "t1"),
    ]
    # And the claim is NOT released: a duplicate cannot run until the lease expires
    rec = world.record()
    assert (rec.state, world.ordinal(rec.token)) == (State.IN_PROGRESS, 1)
    duplicate = Body()
    with pytest.raises(Requeue):
        world.gate(wait=0).run(attempt("t2"), duplicate)
    assert duplicate.runs == 0


def test_a_record_that_fails_once_is_retried_and_recorded(world: World) -> None:
    flaky = FlakyStore(world.memory)
    flaky.fail_next["record"] = 1
    world.store = flaky

    assert world.gate().run(attempt("t1"), Body(result=7)).value == 7

    assert flaky.calls["record"] == 2
    assert len(world.clock.sleeps) == 1
    assert world.events == [(Outcome.CLAIMED, KEY, 1, "t1"), (Outcome.RECORDED, KEY, 1, "t1")]
    assert world.result_of(world.record()) == 7


def test_a_record_whose_reply_was_lost_is_retried_without_a_lease_lost(world: World) -> None:
    # Given the first record is written but its reply never arrives
    flaky = FlakyStore(world.memory)
    flaky.lose_reply["record"] = 1
    world.store = flaky
    # Then retrying the same record succeeds (record is idempotent for its holder)
    assert world.gate().run(attempt("t1"), Body(result="once")).value == "once"
    assert world.events[-1] == (Outcome.RECORDED, KEY, 1, "t1")
    assert world.result_of(world.record()) == "once"


def test_a_result_that_cannot_be_encoded_is_recorded_as_failed_and_never_rerun(
    world: World,
) -> None:
    # Given a body whose effect happens but whose result the json serializer cannot encode
    body = Body(result=object())
    with pytest.raises(kombu.exceptions.EncodeError):
        world.gate().run(attempt("t1"), body)
    # Then the key is failed, so no duplicate repeats the effect
    assert world.record().state is State.FAILED
    for task_id in ("t1", "t2"):
        with pytest.raises(TypeError, match="cannot be encoded"):
            world.gate().run(attempt(task_id, retries=1), body)
    assert body.runs == 1


# -- fencing tokens ---------------------------------------------------------------------------


def test_the_token_strictly_increases_across_claim_release_claim_and_takeover(
    world: World,
) -> None:
    tokens: list[int] = []
    # claim (1) -> timeout-class error -> released
    with pytest.raises(TimeoutError):
        world.gate().run(attempt("t1"), Body(raises=TimeoutError(), during=tokens.append))
    # claim (2) -> unclassified error -> held, then the lease expires
    with pytest.raises(ValueError):
        world.gate().run(attempt("t1", 1), Body(raises=ValueError(), during=tokens.append))
    world.clock.advance(LEASE + 1)
    # takeover (3) -> recorded
    world.gate().run(attempt("t2"), Body(result="done", during=tokens.append))

    assert world.ordinals(tokens) == [1, 2, 3]
    assert [(event[0], event[2]) for event in world.events] == [
        (Outcome.CLAIMED, 1), (Outcome.RELEASED, 1),
        (Outcome.CLAIMED, 2), (Outcome.HELD, 2),
        (Outcome.TAKEOVER, 3), (Outcome.RECORDED, 3),
    ]
    # And no earlier token can write any more
    for stale in (world.T(1), world.T(2)):
        with pytest.raises(LeaseLost):
            world.memory.record(KEY, stale, state=State.DONE, content_type="x", data=b"", ttl=TTL)


@pytest.mark.parametrize("same_token", [False, True], ids=["clock moved on", "token reissued"])
def test_a_holder_whose_record_the_store_lost_cannot_record_over_the_next_claim(
    world: World, same_token: bool
) -> None:
    # Given a holder running its body when the store loses its record (FLUSHALL, a restart
    # without persistence), and a duplicate that claims the key afresh meanwhile
    second = Body(result="from t2")

    def lose_and_reclaim(token: int) -> None:
        with world.memory._lock:
            world.memory._records.clear()
        if same_token:
            # The store clock stepped back to the stale claim's instant: the token repeats.
            world.clock.now = START
            world.memory.clock_stepped_back = True
        else:
            world.clock.advance(0.5)
        world.gate().run(attempt("t2"), second)

    stale = Body(result="from t1", during=lose_and_reclaim)
    # When the stale holder's body returns, its record is refused
    with pytest.raises(LeaseLost):
        world.gate().run(attempt("t1"), stale)
    # Then the second claim's token is above the stale one (or, when the clock stepped back,
    # equal: the claim id still tells the two claims apart), and the record is the second's
    (t1,), (t2,) = stale.tokens, second.tokens
    assert t2 == t1 if same_token else t2 > t1
    rec = world.record()
    assert (rec.state, rec.token, rec.task_id, world.result_of(rec)) == (
        State.DONE, t2, "t2", "from t2")
    assert [e[0] for e in world.events] == [
        Outcome.CLAIMED, Outcome.CLAIMED, Outcome.RECORDED, Outcome.LEASE_LOST]


def test_a_claim_kept_alive_by_renewals_outlives_the_record_ttl(world: World) -> None:
    # Given a task whose body runs longer than its ttl, with its lease renewed every lease/3
    # (as the keeper does), so the claim is live the whole time
    ttl, lease = 60.0, 30.0
    duplicate = Body(result="second copy")
    findings: list[str] = []

    def long_body(token: int) -> None:
        for _ in range(9):  # 90 s of work
            world.clock.advance(lease / 3)
            try:
                world.memory.renew(KEY, token, lease)
            except LeaseLost as exc:
                findings.append(f"renew refused: {exc}")
                break
        # When a duplicate arrives while the holder is still running
        try:
            world.gate(ttl=ttl, lease=lease, wait=0).run(attempt("t2"), duplicate)
        except Requeue:
            findings.append("busy")

    with contextlib.suppress(LeaseLost):
        world.gate(ttl=ttl, lease=lease).run(attempt("t1"), Body(result="long", during=long_body))
    # Then every renewal succeeded, and the duplicate found the key busy and did not run (a
    # second run would even hold the same token as the live holder)
    assert findings == ["busy"]
    assert world.ordinals(duplicate.tokens) == []


# -- the lease heartbeat (real time, on purpose) ----------------------------------------------


def test_the_keeper_renews_the_lease_while_a_long_body_runs() -> None:
    # Given a real-clock store and a 0.3 s lease (renewed every 0.1 s)
    lease = 0.3
    store = MemoryStore(prefix="unit:")
    keeper = SpyKeeper()
    gate = Gate(store, dataclasses.replace(CONFIG, lease=lease, wait=0), KombuCodec("json"),
                lease_keeper=keeper)
    stop = threading.Event()
    seen: dict[str, Any] = {}

    def body(token: int) -> str:
        first = store.get(KEY)
        assert first is not None and first.lease_expires is not None
        started = time.monotonic()
        # Run for well over the lease, until the lease has visibly moved (bounded by a deadline)
        deadline = started + 5.0
        while time.monotonic() < deadline:
            stop.wait(0.02)
            rec = store.get(KEY)
            assert rec is not None
            if time.monotonic() - started > 2 * lease and rec.lease_expires > first.lease_expires:
                break
        seen["elapsed"] = time.monotonic() - started
        # A concurrent claim after more than one lease length finds the claim live
        seen["concurrent"] = store.claim(KEY, owner="o", task_id="t2", attempt=0, lease=lease,
                                         ttl=TTL).status
        return "long"

    assert gate.run(attempt("t1"), body).value == "long"

    assert seen["elapsed"] > 2 * lease
    assert seen["concurrent"] is ClaimStatus.BUSY
    assert keeper.held[0].renewals >= 1
    assert not keeper.held[0].lost.is_set()
    assert store.get(KEY) is not None and store.get(KEY).state is State.DONE  # type: ignore[union-attr]


def test_the_keeper_flags_a_lease_another_holder_took_over(world: World) -> None:
    # Given a real keeper (real-time schedule) over the fake-clock store, and a 0.3 s lease
    keeper = SpyKeeper()
    gate = world.gate(lease=0.3, lease_keeper=keeper)
    flagged: list[bool] = []

    def body(token: int) -> None:
        # When the store's clock passes the lease and a duplicate takes over
        world.clock.advance(1)
        taken = world.memory.claim(KEY, owner="o", task_id="t2", attempt=0, lease=30, ttl=TTL)
        assert taken.status is ClaimStatus.TAKEOVER
        # Then the keeper's next renewal (about 0.1 s from now) sets the lost flag
        flagged.append(keeper.held[0].lost.wait(timeout=5.0))

    with pytest.raises(LeaseLost):
        gate.run(attempt("t1"), body)
    assert flagged == [True]


def test_a_renewal_that_arrives_after_the_holders_own_record_is_not_a_lost_lease(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a holder that recorded its result (the store now fences its token's renewals)
    claim = world.memory.claim(KEY, owner="o", task_id="t1", attempt=0, lease=LEASE, ttl=TTL)
    world.memory.record(KEY, claim.token, state=State.DONE, content_type="application/json",
                        data=b"1", ttl=TTL)
    lease = Lease(world.memory, KEY, Fence(claim.token), LEASE)
    lease.done = True
    # When a renewal delayed past that record reaches the store
    with caplog.at_level(logging.DEBUG, logger="celery_idem"):
        LeaseKeeper()._renew(lease)
    # Then it is refused quietly: nothing was lost, no ERROR, the flag stays down
    assert not lease.lost.is_set()
    # (only this thread's records: the process-wide keeper thread may be renewing another
    # test's leftover lease meanwhile)
    mine = [r for r in caplog.records if r.thread == threading.get_ident()]
    assert [r for r in mine if r.levelno >= logging.ERROR] == []
    assert "late renewal refused" in caplog.text
    # And the same refusal for a holder still running is a lost lease
    live = Lease(world.memory, KEY, Fence(claim.token), LEASE)
    LeaseKeeper()._renew(live)
    assert live.lost.is_set()
