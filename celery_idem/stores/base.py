"""The store contract: the atomic verbs the gate is built on.

A store keeps one record per idempotency key. Each verb below is ONE atomic operation (one
round trip to the server): a Redis Lua script, or one conditional SQL statement. All lease
arithmetic uses the store's own clock, so workers with skewed clocks still agree on expiry.

Fencing: every claim that succeeds (a fresh claim or a takeover) gets a token strictly greater
than any token the key had before, *including* tokens of released claims (a release keeps a
tombstone with the token). ``record``, ``release`` and ``renew`` succeed only for the current
token; a holder whose lease was taken over gets :class:`~celery_idem.exceptions.LeaseLost`.

Timeline of one key::

    claim(t=1) ──run──> record(1) ─────────────> done  (duplicates get the result)
    claim(t=1) ──run──> release(1) ─> released ─> claim(t=2) ...
    claim(t=1) ──crash ... lease expires ─> claim => TAKEOVER(t=2) ──> record(2) -> done
                                     stale record(1) -> LeaseLost
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from ..exceptions import ImproperlyConfigured
from ..records import Claim, Record, State

__all__ = ["BackendWrite", "Store"]


@dataclass
class BackendWrite:
    """The result backend's write of one task result, for a store that can fold it into a record.

    Celery's Redis backend stores a result as ``SET key value [EX expires]`` plus ``PUBLISH key
    value`` (what ``AsyncResult.get`` listens for). When the idempotency store lives on the same
    server, :meth:`Store.record_with` makes that write in the record's own round trip, fenced like
    the record: one round trip where there were three (record, the backend's ``GET``, its
    ``SET``+``PUBLISH``).

    Attributes:
        key: The backend's result key.
        value: The encoded result meta, exactly as the backend would write it.
        expires: Seconds the key lives (0: no expiry).
        written: Set by the store once the write is made; the caller skips the backend's own
            write only then.
    """

    key: str
    value: bytes | str
    expires: int = 0
    written: bool = False


class Store(abc.ABC):
    """Abstract idempotency store. Subclasses implement every verb atomically.

    Attributes:
        prefix: Prepended to every key in the backing store, so two apps can share a server.
        schemes: URL schemes this store serves (used by :func:`celery_idem.stores.store_from_url`).
    """

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prefix: str = "celery-idem:") -> None:
        self.prefix = prefix

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, *, prefix: str = "celery-idem:", **options: Any) -> Store:
        """Build the store from a URL of one of its ``schemes``; ``options`` go to the client."""

    @abc.abstractmethod
    def claim(
        self,
        key: str,
        *,
        owner: str,
        task_id: str,
        attempt: int,
        lease: float,
        ttl: float,
        payload_hash: str | None = None,
    ) -> Claim:
        """Atomically claim ``key`` for one attempt, or say why not.

        Decides, in this order, in one round trip:

        1. absent or RELEASED: write IN_PROGRESS with token = previous token + 1 -> CLAIMED;
        2. ``payload_hash`` given, a hash is stored and they differ -> MISMATCH;
        3. DONE -> DONE; FAILED -> FAILED (with the record, so the caller can answer);
        4. IN_PROGRESS whose lease has expired, or whose holder is an earlier attempt of the
           same ``task_id`` (``attempt`` is higher: Celery published a retry) -> write
           IN_PROGRESS with token + 1 -> TAKEOVER;
        5. otherwise -> BUSY with the live holder's record.

        Args:
            key: The idempotency key.
            owner: Who claims (``host:pid``), for operators.
            task_id: The claiming task id.
            attempt: The claiming request's ``retries``.
            lease: Seconds the claim lives without a renewal.
            ttl: Seconds the record lives in the store (the in-progress record included).
            payload_hash: Hash of the full arguments, or None to skip validation.

        Returns:
            The decision, the token and the record found before the claim.

        Raises:
            StoreUnavailable: The store could not be reached; nothing was written.
            CorruptRecord: The stored record cannot be read.
        """

    @abc.abstractmethod
    def record(
        self,
        key: str,
        token: int,
        *,
        state: State,
        content_type: str,
        data: bytes,
        ttl: float,
    ) -> None:
        """Atomically turn the caller's IN_PROGRESS record into DONE or FAILED. Fenced.

        Idempotent for the holder: recording the same token again (a retry after a lost reply)
        succeeds without changing anything.

        Raises:
            LeaseLost: The record's token is not ``token`` (someone took over) or it is gone.
            StoreUnavailable: The store could not be reached (the write may or may not have
                happened; retrying is safe).
            ValueError: ``state`` is not DONE or FAILED.
        """

    def record_with(
        self,
        key: str,
        token: int,
        *,
        state: State,
        content_type: str,
        data: bytes,
        ttl: float,
        also: BackendWrite,
    ) -> None:
        """:meth:`record`, and ``also`` in the same atomic step when the store can do that.

        The default only records: ``also.written`` stays False and the caller leaves the result
        to the backend. Raises what :meth:`record` raises; ``also`` is written only when the
        record is (the same fence).
        """
        self.record(key, token, state=state, content_type=content_type, data=data, ttl=ttl)

    @abc.abstractmethod
    def release(self, key: str, token: int) -> None:
        """Atomically give the claim back (RELEASED tombstone that keeps the token). Fenced.

        Raises:
            LeaseLost: The record's token is not ``token``, or the record is not in progress.
            StoreUnavailable: The store could not be reached.
        """

    @abc.abstractmethod
    def renew(self, key: str, token: int, lease: float) -> float:
        """Atomically extend the caller's lease to store-now + ``lease``. Fenced.

        Returns:
            The new lease expiry (store clock, epoch seconds).

        Raises:
            LeaseLost: The record's token is not ``token``, or it is not in progress.
            StoreUnavailable: The store could not be reached.
        """

    @abc.abstractmethod
    def get(self, key: str) -> Record | None:
        """Read one record (one round trip), or None when the key is absent.

        Raises:
            StoreUnavailable: The store could not be reached.
            CorruptRecord: The stored record cannot be read.
        """

    @abc.abstractmethod
    def scan(self, state: State | None = None, count: int = 100) -> Iterator[Record]:
        """Iterate over records, optionally of one state, in batches of about ``count``.

        For operators and the CLI; not atomic as a whole and never on the hot path.
        """

    # -- operator verbs (the CLI; never on a task's path) ---------------------------------------

    def forget(self, key: str, token: int) -> None:
        """Atomically forget a done or failed outcome, so the next attempt runs the body. Fenced.

        The record becomes a RELEASED tombstone that keeps the token (as :meth:`release`
        leaves a claim): the next claim gets token + 1. Not abstract, so a store written before
        it still loads; such a store refuses the verb.

        Raises:
            LeaseLost: The record's token is not ``token``, or it is not done or failed.
            ImproperlyConfigured: This store does not implement it.
            StoreUnavailable: The store could not be reached.
        """
        raise ImproperlyConfigured(f"{type(self).__name__} cannot forget records")

    def expires_at(self, key: str) -> float | None:
        """When the record of ``key`` expires (store clock, epoch seconds); None if unknown.

        One read for operators (``idem show``); a task never needs it.
        """
        return None

    def now(self) -> float:
        """The store's clock (epoch seconds); the in-process clock unless a store overrides."""
        import time

        return time.time()

    def close(self) -> None:  # noqa: B027 - optional hook, most stores have nothing to close
        """Release connections. The store must not be used afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} prefix={self.prefix!r}>"
