"""The claim's decision as SQL: a claim's arguments, and the CASE every dialect decides with.

:meth:`ClaimArgs.status` is the single SQL definition of the order in
:meth:`celery_idem.stores.base.Store.claim`. Internal to the SQL store package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause

from ...records import ClaimStatus, State

__all__ = ["HOLDS", "LOCKED", "ClaimArgs", "ClaimRaced", "claim_params", "claim_template",
           "literal_or_bind"]

#: The claim statuses under which the caller holds the key (the claim wrote its row).
HOLDS: Final = (ClaimStatus.CLAIMED.value, ClaimStatus.TAKEOVER.value)
# The statuses the PostgreSQL claim decides again on the locked row (see build_pg_claim).
LOCKED: Final = (*HOLDS, ClaimStatus.BUSY.value)


@dataclass(frozen=True)
class ClaimArgs:
    """One claim's arguments, and the two SQL fragments every dialect builds from them."""

    stored_key: str
    owner: str
    task_id: str
    attempt: int
    lease: float
    ttl: float
    payload_hash: str | None
    claim_id: str

    def status(self, row: FromClause, now: ColumnElement[float]) -> ColumnElement[str | None]:
        """The decision on ``row`` at ``now`` in the order of :meth:`Store.claim`, as a CASE.

        ``row`` may be an outer join's NULL row (absent); the CASE is NULL for an unknown state.
        """
        c = row.c
        in_progress = c.state == State.IN_PROGRESS.value
        lease_expired = sa.and_(c.lease_expires.is_not(None), c.lease_expires <= now)
        earlier_attempt_of_same_task = sa.and_(c.task_id == self.task_id, c.attempt < self.attempt)
        # A validating caller (a hash given) refuses a record with another hash or with none.
        validating = isinstance(self.payload_hash, sa.BindParameter) or self.payload_hash
        payload_mismatch = (sa.or_(c.payload_hash.is_(None), c.payload_hash != self.payload_hash)
                            if validating else sa.false())
        return sa.case(
            (sa.or_(c.key.is_(None), c.expires <= now, c.state == State.RELEASED.value),
             ClaimStatus.CLAIMED.value),
            (payload_mismatch, ClaimStatus.MISMATCH.value),
            (c.state == State.DONE.value, ClaimStatus.DONE.value),
            (c.state == State.FAILED.value, ClaimStatus.FAILED.value),
            (sa.and_(in_progress, sa.or_(lease_expired, earlier_attempt_of_same_task)),
             ClaimStatus.TAKEOVER.value),
            (in_progress, ClaimStatus.BUSY.value),
            else_=sa.null(),
        )

    def values(self, *, now: ColumnElement[float], token: Any) -> dict[str, Any]:
        """The IN_PROGRESS row a taking claim writes, in column order."""
        return {
            "key": literal_or_bind(self.stored_key, sa.String),
            "state": sa.literal(State.IN_PROGRESS.value, sa.String),
            "token": token,
            "owner": literal_or_bind(self.owner, sa.String),
            "task_id": literal_or_bind(self.task_id, sa.String),
            "attempt": literal_or_bind(self.attempt, sa.Integer),
            "lease_expires": now + self.lease,
            "payload_hash": literal_or_bind(self.payload_hash, sa.String),
            "content_type": sa.null(),
            "data": sa.null(),
            "updated": now,
            "expires": now + self.ttl,
            "claim_id": literal_or_bind(self.claim_id, sa.String),
        }


def literal_or_bind(value: Any, type_: Any) -> Any:
    """A SQL literal for a plain value; a bind parameter (a cached statement's slot) as it is."""
    return value if isinstance(value, sa.BindParameter) else sa.literal(value, type_)


def claim_template(validate: bool) -> ClaimArgs:
    """Claim arguments as named bind parameters, to build a claim statement once and reuse it."""
    return ClaimArgs(
        stored_key=sa.bindparam("idem_key", type_=sa.String),  # type: ignore[arg-type, unused-ignore]
        owner=sa.bindparam("idem_owner", type_=sa.String),  # type: ignore[arg-type, unused-ignore]
        task_id=sa.bindparam("idem_task_id", type_=sa.String),  # type: ignore[arg-type, unused-ignore]
        attempt=sa.bindparam("idem_attempt", type_=sa.Integer),  # type: ignore[arg-type, unused-ignore]
        lease=sa.bindparam("idem_lease", type_=sa.Double),  # type: ignore[arg-type, unused-ignore]
        ttl=sa.bindparam("idem_ttl", type_=sa.Double),  # type: ignore[arg-type, unused-ignore]
        # Validation changes the predicates' shape (a constant false without a hash).
        payload_hash=sa.bindparam("idem_payload_hash", type_=sa.String) if validate else None,  # type: ignore[arg-type, unused-ignore]
        claim_id=sa.bindparam("idem_claim_id", type_=sa.String),  # type: ignore[arg-type, unused-ignore]
    )


def claim_params(args: ClaimArgs) -> dict[str, Any]:
    return {
        "idem_key": args.stored_key, "idem_owner": args.owner, "idem_task_id": args.task_id,
        "idem_attempt": args.attempt, "idem_lease": args.lease, "idem_ttl": args.ttl,
        "idem_payload_hash": args.payload_hash, "idem_claim_id": args.claim_id,
    }


class ClaimRaced(Exception):
    """The row a claim decided on changed before the claim's write, which wrote nothing.

    Typically two first claims of an absent key: the loser's INSERT meets the winner's row.
    """

