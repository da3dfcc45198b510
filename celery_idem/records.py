"""The values that travel between the gate and a store, and the receipt a later attempt finds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Claim", "ClaimStatus", "Intent", "Receipt", "Record", "Reservation", "State"]


class State(str, enum.Enum):
    """The state of one key's record in the store."""

    #: A holder has claimed the key and is running the body under a lease.
    IN_PROGRESS = "in_progress"
    #: The body finished; the record holds its encoded result.
    DONE = "done"
    #: The body raised a terminal error; the record holds the encoded error.
    FAILED = "failed"
    #: The holder gave the key back (timeout-class error): a tombstone keeping the fencing token,
    #: so the next claim gets a higher token than any earlier holder.
    RELEASED = "released"


class ClaimStatus(str, enum.Enum):
    """What :meth:`Store.claim` decided, atomically, in one round trip."""

    #: The key was free (absent or released): the caller now holds it.
    CLAIMED = "claimed"
    #: The holder's lease had expired, or it was an earlier attempt of the same task id (a retry):
    #: the caller now holds it with token + 1.
    TAKEOVER = "takeover"
    #: The key is done; ``record`` carries the result.
    DONE = "done"
    #: The key failed terminally; ``record`` carries the error.
    FAILED = "failed"
    #: Another holder's lease is live; ``record`` describes it.
    BUSY = "busy"
    #: The stored payload hash differs from the caller's (``idempotency_validate``).
    MISMATCH = "mismatch"

    @property
    def holds(self) -> bool:
        """True when the caller now holds the key and must run the body."""
        return self in (ClaimStatus.CLAIMED, ClaimStatus.TAKEOVER)


@dataclass(frozen=True)
class Record:
    """One key's record as read from the store.

    Attributes:
        key: The idempotency key (without the store's prefix).
        state: The record's state.
        token: The fencing token of the latest claim; strictly increasing per key, also across
            a loss of the record (docs/fencing.md).
        owner: Who holds or held the claim (``host:pid``).
        task_id: The Celery task id of the attempt that claimed it (the original task id).
        attempt: The ``retries`` count of that attempt.
        lease_expires: Server time (epoch seconds) the lease runs out at; None unless in progress.
        payload_hash: Hash of the full arguments, when ``idempotency_validate`` is on.
        content_type: MIME type of ``data`` (the result serializer's, or the error codec's).
        data: The encoded result (done) or error (failed).
        updated: Server time (epoch seconds) of the last write.
        claim_id: The random id of the claim that wrote it (:attr:`Claim.claim_id`); empty for a
            released tombstone, and from a store without claim ids.
    """

    key: str
    state: State
    token: int
    owner: str = ""
    task_id: str = ""
    attempt: int = 0
    lease_expires: float | None = None
    payload_hash: str | None = None
    content_type: str | None = None
    data: bytes | None = None
    updated: float | None = None
    claim_id: str = ""


@dataclass(frozen=True)
class Claim:
    """The answer of :meth:`Store.claim`.

    Attributes:
        status: What the store decided.
        token: The caller's fencing token when ``status.holds``, else the current holder's.
        record: The record found before the claim (None when the key was absent): the result for
            DONE, the error for FAILED, the live holder for BUSY, the expired holder for TAKEOVER.
        now: The store's clock at the claim (epoch seconds): lease arithmetic never mixes hosts' clocks.
        claim_id: When ``status.holds``, the random id of the caller's claim, passed with the
            token to ``record``, ``release`` and ``renew`` (a stale holder is refused even if
            a token was reissued); empty otherwise, and from a store without claim ids.
    """

    status: ClaimStatus
    token: int
    record: Record | None
    now: float
    claim_id: str = ""


@dataclass(eq=False)
class Receipt:
    """A committed receipt found by a later attempt (``idempotent_transaction``, SQLAlchemy or Django).

    Attributes:
        key: The stored key (prefix + idempotency key).
        token: Fencing token of the attempt that committed it.
        task_id: Task id of the attempt that committed it.
        value: Its result, decoded (left out of the repr).
    """

    key: str
    token: int
    task_id: str
    value: Any = field(repr=False)


@dataclass(frozen=True)
class Reservation:
    """A queued message's hold on a key no attempt has claimed yet (see ``Store.reserve``).

    Attributes:
        task_id: The task id of the message that reserved the key.
        fingerprint: The fingerprint its call would store (None: the key has none).
    """

    task_id: str
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Intent:
    """A message the store keeps until an attempt records its action's outcome (the relay re-sends
    it when it is due and lost; ``idempotency_intent``, docs/reliability.md).

    Attributes:
        key: The stored idempotency key (the scope included), without the store's prefix.
        task_id: The message's task id (a re-sent message keeps it, so its caller's handle answers).
        queue: The queue the message went to (the relay asks the broker for its length).
        message: The encoded message, opaque to stores (:func:`celery_idem.intents.decode_envelope`
            reads it).
        enqueued: Store clock (epoch seconds) when it was written: its place in its queue, which
            a claim seen of it tells the relay every earlier message there was delivered.
        deadline: Store clock after which the relay looks at it.
        expires: Store clock after which it is stale: its record may be gone, it is never re-sent.
        sent: Store clock of its latest send (``enqueued``, or a relay's re-send): its copy waits
            behind what the queue held then.
    """

    key: str
    task_id: str
    queue: str
    message: bytes = field(repr=False)
    enqueued: float
    deadline: float
    expires: float
    sent: float = 0.0
