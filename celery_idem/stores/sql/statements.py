"""The statements of the fenced writes and the reads, built once per table.

Internal to the SQL store package; the claim's statements are in
:mod:`celery_idem.stores.sql.claims`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from ...records import State
from .schema import db_now

__all__ = ["VerbStatements"]


@dataclass(frozen=True)
class VerbStatements:
    """The fenced writes' and the reads' statements, built once per table.

    Each call's values are ``idem_*`` bind parameters; the key and token ones take the type of
    the column they are compared with, as the literal values they replace did.
    """

    record: sa.Update
    release: sa.Update
    renew: sa.Update
    renew_returning: sa.Update  # renew handing back the new lease, where UPDATE can RETURNING
    renew_read: sa.Select[Any]  # where it cannot: the new lease read back, still fenced
    get: sa.Select[Any]
    forget: sa.Update  # an operator's verb: a DONE or FAILED row, fenced by the token alone

    @classmethod
    def build(cls, t: sa.Table) -> VerbStatements:
        key: sa.BindParameter[str] = sa.bindparam("idem_key")
        claim_id: sa.BindParameter[str] = sa.bindparam("idem_claim_id", type_=t.c.claim_id.type)
        # Only the holder's live IN_PROGRESS row: the fence of record, release and renew. The
        # claim id names the claim beside the token ('' = a caller that checks the token alone).
        fenced = sa.and_(
            t.c.key == key,
            t.c.token == sa.bindparam("idem_token"),
            sa.or_(claim_id == "", t.c.claim_id == claim_id),
            t.c.state == State.IN_PROGRESS.value,
            t.c.expires > db_now(),
        )
        lease = sa.bindparam("idem_lease", type_=sa.Double)
        # The record must outlive the lease too: a body running past the TTL keeps its record
        # (and with it the token that fences every earlier holder).
        renew = sa.update(t).where(fenced).values(
            lease_expires=db_now() + lease,
            expires=sa.case((t.c.expires < db_now() + lease, db_now() + lease), else_=t.c.expires),
        )
        # A RELEASED tombstone keeps the token and the TTL, and nothing of the holder.
        tombstone = {"state": State.RELEASED.value, "owner": "", "task_id": "", "attempt": 0,
                     "lease_expires": None, "payload_hash": None, "content_type": None,
                     "data": None, "updated": db_now()}
        return cls(
            record=sa.update(t).where(fenced).values(
                state=sa.bindparam("idem_state"),
                content_type=sa.bindparam("idem_content_type"),
                data=sa.bindparam("idem_data", type_=t.c.data.type),
                lease_expires=None,
                updated=db_now(),
                expires=db_now() + sa.bindparam("idem_ttl", type_=sa.Double),
            ),
            release=sa.update(t).where(fenced).values(**tombstone, claim_id=None),
            renew=renew,
            renew_returning=renew.returning(t.c.lease_expires),
            renew_read=sa.select(t.c.lease_expires).where(fenced),
            get=sa.select(t).where(t.c.key == key, t.c.expires > db_now()),
            forget=sa.update(t).where(
                t.c.key == key,
                t.c.token == sa.bindparam("idem_token"),
                sa.or_(t.c.state == State.DONE.value, t.c.state == State.FAILED.value),
                t.c.expires > db_now(),
            ).values(**tombstone),
        )
