"""The store contract: the atomic verbs the gate is built on.

A store keeps one record per idempotency key. Each verb below is ONE atomic operation (one
round trip to the server): a Redis Lua script, or one conditional SQL statement. All lease
arithmetic uses the store's own clock, so workers with skewed clocks still agree on expiry.

Fencing: every taking claim gets a token above any the key had, released and lost ones
included (:func:`next_token`; why it holds across a loss of the store, and until when:
docs/fencing.md), and a random claim id (:func:`new_claim_id`), since a token number may be
issued twice after a loss with a clock that stepped back. ``record``, ``release`` and ``renew``
succeed only for the current claim, named by its token *and* claim id (``claim_id=None`` checks
the token alone); any other holder gets :class:`~celery_idem.exceptions.LeaseLost`::

    claim(t=1) ──run──> record(1) ─────────────> done  (duplicates get the result)
    claim(t=1) ──run──> release(1) ─> released ─> claim(t=2) ...
    claim(t=1) ──crash ... lease expires ─> claim => TAKEOVER(t=2) ──> record(2) -> done
                                     stale record(1) -> LeaseLost
"""

from __future__ import annotations

import abc
import base64
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import DEFAULT_PREFIX
from ..exceptions import CorruptRecord, ImproperlyConfigured, LeaseLost
from ..records import Claim, Intent, Record, Reservation, State

__all__ = ["BackendWrite", "ClaimRaced", "DurabilityFinding", "Fence", "Store", "lease_lost",
           "mysql_byte_collation", "new_claim_id", "next_token", "record_from_row"]

#: Tokens are the store clock in microseconds (see :func:`next_token`).
TOKEN_CLOCK_SCALE = 1_000_000


def next_token(previous: int | None, now: float) -> int:
    """The token of a taking claim: ``max(previous + 1, now in whole microseconds)``.

    Args:
        previous: The key's current token, or None when the store has no record of it.
        now: The store's clock (epoch seconds) at the claim.
    """
    return max((previous or 0) + 1, int(now * TOKEN_CLOCK_SCALE))


def new_claim_id() -> str:
    """A random id for one claim: 48 bits as 8 URL-safe base64 characters (no NUL, no dot)."""
    return base64.urlsafe_b64encode(os.urandom(6)).decode()


def lease_lost(verb: str, key: str, token: int, current: Record | None,
               claim_id: str | None = None) -> LeaseLost:
    """Why a fenced ``verb`` (``"record"``, ...) of ``key`` was refused, in the words every store
    uses; ``current`` is the key's record as the store holds it now (None: gone)."""
    refused = f"{verb} of {key!r} with token {token} refused: the record"
    if current is None:
        why = f"{refused} is gone"
    elif current.token != token:
        why = f"{refused} now has token {current.token}"
    elif claim_id and current.claim_id != claim_id and current.state is State.IN_PROGRESS:
        why = (f"{refused} belongs to another claim with the same token (issued again after the "
               f"store lost the row)")
    else:
        why = f"{verb} of {key!r} refused: it is {current.state.value}"
    return LeaseLost(why, key=key, token=token)


def mysql_byte_collation(mariadb: bool, version: tuple[int | str, ...]) -> str:
    """The NO PAD binary collation of MySQL or MariaDB (``utf8mb4_bin`` ignores trailing spaces:
    ``K`` and ``K `` would be one key); MySQL before 8.0.17 has none, ``utf8mb4_bin`` is closest."""
    if mariadb:
        return "utf8mb4_nopad_bin"
    return "utf8mb4_0900_bin" if tuple(version[:3]) >= (8, 0, 17) else "utf8mb4_bin"


class ClaimRaced(Exception):
    """Raised inside a SQL store when the row a claim decided on changed before its write,
    which wrote nothing (typically two first claims of an absent key: the loser's INSERT meets
    the winner's row); the claim runs again on the winner's row."""


def record_from_row(row: Mapping[str, Any], prefix: str, table: str) -> Record:
    """The record of one SQL row by column name; CorruptRecord when it cannot be read (an
    unknown state, a NULL where a value belongs)."""
    key = str(row["key"])[len(prefix):]
    try:
        data, lease_expires = row["data"], row["lease_expires"]
        return Record(
            key=key, state=State(row["state"]), token=int(row["token"]), owner=str(row["owner"]),
            task_id=str(row["task_id"]), attempt=int(row["attempt"]),
            lease_expires=None if lease_expires is None else float(lease_expires),
            payload_hash=row["payload_hash"], content_type=row["content_type"],
            data=None if data is None else bytes(data), updated=float(row["updated"]),
            claim_id=row["claim_id"] or "")
    except (ValueError, TypeError) as exc:
        raise CorruptRecord(f"the record of {key!r} in SQL table {table!r} cannot be read: {exc}",
                            key=key) from exc


@dataclass(frozen=True, slots=True)
class Fence:
    """What names one claim to the fenced verbs (``record``, ``release``, ``renew``).

    Attributes:
        token: The claim's fencing token.
        claim_id: The claim's random id (:attr:`Claim.claim_id`), never issued twice as a token
            may be after a loss; empty: the token alone is checked (an operator's release).
    """

    token: int
    claim_id: str = ""


@dataclass(frozen=True)
class DurabilityFinding:
    """One thing :meth:`Store.check_durability` found about the store's server.

    Attributes:
        setting: The server setting it is about (``appendonly``), or what could not be read.
        value: Its value, or None when it could not be read.
        risk: What it means for records, in a sentence an operator can act on.
        level: ``logging.WARNING`` when records can be lost (the worker start warns, or refuses
            with ``idempotency_require_durable_store``); ``logging.INFO`` for a note (the
            settings could not be read, e.g. a managed Redis that refuses ``CONFIG``).
        fix: What to change; the worker start names each distinct fix once.
    """

    setting: str
    value: str | None
    risk: str
    level: int = logging.WARNING
    fix: str = "see the risk above"


@dataclass(frozen=True)
class BackendWrite:
    """The result backend's write of one task result, which :meth:`Store.record_with` makes in
    the record's own round trip, fenced like it, when the store lives on the backend's server.

    Attributes:
        key: The backend's result key.
        value: The encoded result meta, exactly as the backend would write it.
        expires: Seconds the key lives (0: no expiry).
    """

    key: str
    value: bytes | str
    expires: int = 0


class Store(abc.ABC):
    """Abstract idempotency store. Subclasses implement every verb atomically.

    Attributes:
        prefix: Prepended to every key in the backing store, so two apps can share a server.
    """

    #: Whether ``from_url`` takes an ``accelerate`` option (see :mod:`celery_idem.paths`).
    accelerates: ClassVar[bool] = False
    #: Whether ``from_url`` takes the app's ``result_backend_transport_options``
    #: (``backend_transport_options``), as a Sentinel store does for its master's name.
    reads_transport_options: ClassVar[bool] = False

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, **options: Any) -> Store:
        """Build the store from a URL whose scheme ``store_from_url`` maps to this class
        (``options`` go to the client)."""

    @abc.abstractmethod
    def claim(self, key: str, *, owner: str, task_id: str, attempt: int, lease: float, ttl: float,
              payload_hash: str | None = None) -> Claim:
        """Atomically claim ``key`` for one attempt, or say why not.

        Decides, in this order, in one round trip:

        1. absent or RELEASED: write IN_PROGRESS with token = :func:`next_token` of the previous
           token (if any) and the store clock, and a new claim id -> CLAIMED;
        2. ``payload_hash`` given and the record stores another hash, or none -> MISMATCH (a
           record without a hash cannot show it is the same action);
        3. DONE -> DONE; FAILED -> FAILED (with the record, so the caller can answer);
        4. IN_PROGRESS whose lease has expired, or whose holder is an earlier attempt of the
           same ``task_id`` (``attempt`` is higher: Celery published a retry) -> write
           IN_PROGRESS with the next token and a new claim id -> TAKEOVER;
        5. otherwise -> BUSY with the live holder's record.

        Args:
            key: The idempotency key.
            owner: Who claims (``host:pid``), for operators.
            task_id: The claiming task id.
            attempt: The claiming request's ``retries``.
            lease: Seconds the claim lives without a renewal.
            ttl: Seconds the record lives in the store (the in-progress record included).
            payload_hash: The call's fingerprint (a per-call key's identifying arguments, or
                all of them under ``idempotency_validate``), or None to skip validation.

        Returns:
            The decision, the token (and, when the caller holds the key, its claim id) and the
            record found before the claim.

        Raises:
            StoreUnavailable: The store could not be reached; nothing was written.
            CorruptRecord: The stored record cannot be read.
        """

    @abc.abstractmethod
    def record(self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
               claim_id: str | None = None) -> None:
        """Atomically turn the caller's IN_PROGRESS record into DONE or FAILED. Fenced.

        Idempotent for the holder: recording the same token (and claim id) again (a retry after
        a lost reply) succeeds without changing anything.

        Args:
            claim_id: The caller's :attr:`Claim.claim_id`; None checks the token alone.

        Raises:
            LeaseLost: The record's token is not ``token``, or its claim id is not ``claim_id``
                (someone took over, or the claim was reissued after a loss), or it is gone.
            StoreUnavailable: The store could not be reached (the write may or may not have
                happened; retrying is safe).
            ValueError: ``state`` is not DONE or FAILED.
        """

    def record_with(self, key: str, token: int, *, state: State, content_type: str, data: bytes, ttl: float,
                    also: BackendWrite, claim_id: str | None = None) -> bool:
        """:meth:`record`, and ``also`` in the same atomic step (the same fence) when the store can:
        the result fold (:mod:`celery_idem.results_redis`, ``results_db``). Raises as :meth:`record`.

        Returns:
            True when ``also`` was written with the record; False when only the record was
            (the default: the caller leaves the result to the backend).
        """
        self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl, claim_id=claim_id)
        return False

    @abc.abstractmethod
    def release(self, key: str, token: int, *, claim_id: str | None = None) -> None:
        """Atomically give the claim back (RELEASED tombstone that keeps the token). Fenced.

        Raises:
            LeaseLost: The record's token is not ``token`` or its claim id not ``claim_id``, or
                the record is not in progress.
            StoreUnavailable: The store could not be reached.
        """

    @abc.abstractmethod
    def renew(self, key: str, token: int, lease: float, *, claim_id: str | None = None) -> float:
        """Atomically extend the caller's lease to store-now + ``lease``. Fenced.

        Returns:
            The new lease expiry (store clock, epoch seconds).

        Raises:
            LeaseLost: The record's token is not ``token`` or its claim id not ``claim_id``, or
                it is not in progress.
            StoreUnavailable: The store could not be reached.
        """

    @abc.abstractmethod
    def get(self, key: str) -> Record | None:
        """Read one record, or None when the key is absent.

        Raises:
            StoreUnavailable: The store could not be reached.
            CorruptRecord: The stored record cannot be read.
        """

    @abc.abstractmethod
    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """Iterate over records, optionally of one state, in batches of about ``count`` (for
        operators; not atomic as a whole and never on the hot path)."""

    # -- reservations (the enqueue check; optional) ---------------------------------------------

    #: Whether :meth:`reserve` leaves reservations. A store without them still answers
    #: :meth:`reserve` with the record (it only reads), and enqueues attach to claims only.
    reserves: ClassVar[bool] = False

    def reserve(self, key: str, task_id: str, lease: float, fingerprint: str | None = None,
                ) -> Record | Reservation | None:
        """Read ``key``'s record and, when no attempt holds or answers it, reserve the key.

        The enqueue check (one round trip): later enqueues attach to ``task_id``'s message. Not
        a claim; it expires after ``lease`` seconds, so a lost message lets the next one publish.

        Returns:
            The record when one is not released (the caller answers a done or failed one and
            attaches to one in progress); the :class:`Reservation` another message holds; or
            None: the key is now reserved for ``task_id`` (publish it). The default (no
            reservations) returns :meth:`get`'s record.

        Raises:
            StoreUnavailable: The store could not be reached.
            CorruptRecord: The stored record cannot be read.
        """
        return self.get(key)

    def reservation(self, key: str) -> Reservation | None:
        """The live reservation of ``key``, if any (None for a store without them)."""
        return None

    def unreserve(self, key: str, task_id: str) -> None:  # noqa: B027 - optional hook
        """Drop ``task_id``'s reservation of ``key`` (its publish failed); others are kept."""

    # -- intents (``idempotency_intent``; optional) ---------------------------------------------

    #: Whether the store keeps intents (the verbs below). A task with ``idempotency_intent``
    #: refuses a store without them when the worker starts and at its first enqueue.
    keeps_intents: ClassVar[bool] = False

    def _no_intents(self) -> ImproperlyConfigured:
        return ImproperlyConfigured(f"{type(self).__name__} keeps no intents (idempotency_intent)")

    def intend(self, key: str, task_id: str, queue: str, message: bytes, *, relay_after: float,
               ttl: float, eta: float | None = None) -> Intent:
        """Write (or replace) ``key``'s intent: ``enqueued`` and ``sent`` are the store's now, ``deadline``
        ``max(now, eta) + relay_after``, ``expires`` ``now + ttl``. One round trip.

        Raises:
            StoreUnavailable: The store could not be reached (the enqueue sends nothing).
        """
        raise self._no_intents()

    def due_intents(self, limit: int = 500) -> list[tuple[Intent, Record | None]]:
        """Up to ``limit`` intents whose deadline has passed (earliest first), stale ones included,
        each with its key's record (None: absent, or only reserved). One round trip."""
        raise self._no_intents()

    def reschedule_intent(self, intent: Intent, deadline: float, *, resent: bool = False) -> bool:
        """Move ``intent``'s deadline if the store still holds it as read (same task id and
        deadline): how relays agree which of them re-sends. ``resent`` also sets ``sent`` to
        the store's now. False: another relay moved it first, or it is closed."""
        raise self._no_intents()

    def reschedule_intents(self, moves: Sequence[tuple[Intent, float]], *,
                           resent: bool = False) -> list[bool]:
        """:meth:`reschedule_intent` for each ``(intent, deadline)`` of ``moves``, in order; each
        answer as that verb's. A store that can send them together (a Redis pipeline) makes
        them one round trip; the default calls the verb once per move."""
        return [self.reschedule_intent(intent, deadline, resent=resent) for intent, deadline in moves]

    def close_intent(self, key: str, task_id: str) -> None:
        """Drop ``key``'s intent if it is still ``task_id``'s (its outcome is recorded, or it is stale)."""
        raise self._no_intents()

    def deferring(self) -> Callable[[Callable[[], None]], None] | None:
        """When the store's writes join a transaction the caller has open (Django's ``atomic``, a
        SQLAlchemy session handed over), what runs a callback once it commits, never if it rolls
        back (an intent's enqueue publishes then: the transactional enqueue, docs/reliability.md);
        None: no such transaction, writes commit at once."""
        return None

    def intents(self, count: int = 100) -> Iterator[Intent]:
        """Every intent, in batches of about ``count`` (for operators; not atomic as a whole)."""
        raise self._no_intents()

    def watermarks(self) -> dict[str, float]:
        """Per queue, the newest ``enqueued`` of an intent a relay saw claimed."""
        raise self._no_intents()

    def raise_watermarks(self, marks: Mapping[str, float]) -> None:
        """Set each queue's watermark to the larger of the stored one and ``marks``'."""
        raise self._no_intents()

    # -- operator verbs (the CLI; never on a task's path) ---------------------------------------

    def forget(self, key: str, token: int) -> None:
        """Atomically forget a done or failed outcome, so the next attempt runs the body. Fenced:
        the record becomes a RELEASED tombstone that keeps the token, as :meth:`release` leaves it.

        Raises:
            LeaseLost: The record's token is not ``token``, or it is not done or failed.
            ImproperlyConfigured: This store does not implement it (the verb is optional).
            StoreUnavailable: The store could not be reached.
        """
        raise ImproperlyConfigured(f"{type(self).__name__} cannot forget records")

    def expires_at(self, key: str) -> float | None:
        """When the record of ``key`` expires (store clock, epoch seconds); None if unknown."""
        return None

    def now(self) -> float:
        """The store's clock (epoch seconds); the in-process clock unless a store overrides."""
        return time.time()

    def check_durability(self) -> list[DurabilityFinding]:
        """What about the store's server can lose records (a restart, memory pressure): read once
        at worker start, which logs the findings or refuses to start (see
        ``idempotency_require_durable_store``). The default finds nothing.

        Raises:
            StoreUnavailable: The store could not be reached.
        """
        return []

    def replication_warnings(self) -> list[str]:
        """What an operator must hear at worker start about the store's replicas (a store that
        waits for too few connected ones fails every write); none by default."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, most stores have nothing to close
        """Release connections. The store must not be used afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} prefix={self.prefix!r}>"
