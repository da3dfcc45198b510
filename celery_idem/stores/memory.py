"""In-process store (``memory://``) for unit tests of the gate and eager mode: every verb under
one lock, with an injectable clock. Not shared between processes: never use it with workers."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..config import DEFAULT_PREFIX
from ..records import Claim, ClaimStatus, Intent, Record, State
from .base import Store, lease_lost, new_claim_id, next_token

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """A dict of records guarded by a lock.

    Args:
        prefix: Key prefix (kept for parity with the other stores).
        clock: Returns the current time in epoch seconds; ``time.time`` by default.
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, clock: Callable[[], float] = time.time) -> None:
        super().__init__(prefix)
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, tuple[Record, float]] = {}  # key -> (record, expires_at)
        self._intents: dict[str, Intent] = {}
        self._watermarks: dict[str, float] = {}

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> MemoryStore:
        return cls(prefix=prefix, **options)

    def now(self) -> float:
        return self._clock()

    def _live(self, key: str, now: float) -> Record | None:
        entry = self._records.get(key)
        if entry is not None and entry[1] <= now:
            del self._records[key]
            entry = None
        return None if entry is None else entry[0]

    def claim(self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
              payload_hash: str | None = None) -> Claim:
        with self._lock:
            now = self._clock()
            rec = self._live(key, now)

            def take(status: ClaimStatus) -> Claim:
                token = next_token(rec.token if rec else None, now)
                claim_id = new_claim_id()
                new = Record(
                    key=key, state=State.IN_PROGRESS, token=token, owner=owner, task_id=task_id,
                    attempt=attempt, lease_expires=now + lease, payload_hash=payload_hash,
                    updated=now, claim_id=claim_id)
                self._records[key] = (new, now + ttl)
                return Claim(status, token, rec, now, claim_id)

            if rec is None or rec.state is State.RELEASED:
                return take(ClaimStatus.CLAIMED)
            if payload_hash and rec.payload_hash != payload_hash:
                return Claim(ClaimStatus.MISMATCH, rec.token, rec, now)
            if rec.state in (State.DONE, State.FAILED):
                return Claim(ClaimStatus(rec.state.value), rec.token, rec, now)
            expired = rec.lease_expires is not None and rec.lease_expires <= now
            retried = rec.task_id == task_id and attempt > rec.attempt
            if expired or retried:
                return take(ClaimStatus.TAKEOVER)
            return Claim(ClaimStatus.BUSY, rec.token, rec, now)

    def _fenced(self, key: str, token: int, claim_id: str | None, now: float, verb: str,
                states: tuple[State, ...] = (State.IN_PROGRESS,)) -> Record:
        """The caller's record (its token, its claim id, one of ``states``), else LeaseLost."""
        rec = self._live(key, now)
        if rec is None or rec.token != token or rec.state not in states \
                or (claim_id and rec.claim_id != claim_id):
            raise lease_lost(verb, key, token, rec, claim_id)
        return rec

    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
               claim_id: str | None = None) -> None:
        if state not in (State.DONE, State.FAILED):
            raise ValueError(f"record() takes DONE or FAILED, not {state}")
        with self._lock:
            now = self._clock()
            rec = self._fenced(key, token, claim_id, now, "record", (State.IN_PROGRESS, state))
            if rec.state is state:
                return  # the holder retrying a record whose reply it lost
            new = dataclasses.replace(
                rec, state=state, content_type=content_type, data=data, lease_expires=None,
                updated=now)
            self._records[key] = (new, now + ttl)

    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        with self._lock:
            now = self._clock()
            rec = self._fenced(key, token, claim_id, now, "release")
            tomb = Record(key=key, state=State.RELEASED, token=rec.token, updated=now)
            self._records[key] = (tomb, self._records[key][1])

    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        with self._lock:
            now = self._clock()
            rec = self._fenced(key, token, claim_id, now, "renew")
            # The record must outlive the lease (see renew.lua).
            expires = max(self._records[key][1], now + lease)
            self._records[key] = (dataclasses.replace(rec, lease_expires=now + lease), expires)
            return now + lease

    def forget(self, key: str, token: int) -> None:
        with self._lock:
            now = self._clock()
            rec = self._fenced(key, token, None, now, "forget", (State.DONE, State.FAILED))
            tomb = Record(key=key, state=State.RELEASED, token=rec.token, updated=now)
            self._records[key] = (tomb, self._records[key][1])

    def expires_at(self, key: str) -> float | None:
        with self._lock:
            found = self._records.get(key)
            return found[1] if found is not None and found[1] > self._clock() else None

    def get(self, key: str) -> Record | None:
        with self._lock:
            return self._live(key, self._clock())

    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        with self._lock:
            now = self._clock()
            records = [r for k in list(self._records) if (r := self._live(k, now)) is not None]
        yield from (r for r in records if state is None or r.state is state)

    # -- intents ---------------------------------------------------------------------------------

    keeps_intents = True

    def intend(self, key: str, task_id: str, queue: str, message: bytes, *, relay_after: float,
               ttl: float, eta: float | None = None) -> Intent:
        with self._lock:
            now = self._clock()
            intent = Intent(key, task_id, queue, bytes(message), now,
                            max(now, eta or 0.0) + relay_after, now + ttl, now)
            self._intents[key] = intent
            return intent

    def due_intents(self, limit: int = 500) -> list[tuple[Intent, Record | None]]:
        with self._lock:
            now = self._clock()
            due = sorted((i for i in self._intents.values() if i.deadline <= now),
                         key=lambda i: i.deadline)[:limit]
            return [(i, self._live(i.key, now)) for i in due]

    def reschedule_intent(self, intent: Intent, deadline: float, *, resent: bool = False) -> bool:
        with self._lock:
            held = self._intents.get(intent.key)
            if held is None or held.task_id != intent.task_id or held.deadline != intent.deadline:
                return False
            sent = self._clock() if resent else held.sent
            self._intents[intent.key] = dataclasses.replace(held, deadline=deadline, sent=sent)
            return True

    def close_intent(self, key: str, task_id: str) -> None:
        with self._lock:
            held = self._intents.get(key)
            if held is not None and held.task_id == task_id:
                del self._intents[key]

    def intents(self, count: int = 100) -> Iterator[Intent]:
        with self._lock:
            found = list(self._intents.values())
        yield from found

    def watermarks(self) -> dict[str, float]:
        with self._lock:
            return dict(self._watermarks)

    def raise_watermarks(self, marks: Mapping[str, float]) -> None:
        with self._lock:
            for queue, mark in marks.items():
                self._watermarks[queue] = max(self._watermarks.get(queue, mark), mark)
