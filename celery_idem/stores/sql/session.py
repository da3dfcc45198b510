"""How the store's statements run: the plain path, through a SQLAlchemy ``Connection``.

PostgreSQL through psycopg 3 may run them on psycopg's connection itself instead: an
acceleration (:mod:`celery_idem.accel.sql_psycopg`) with the same ``execute``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.engine import Connection

__all__ = ["Outcome", "Row", "SASession", "Statement"]

# A row by column name (a SQLAlchemy RowMapping, or a dict on the psycopg path).
Row: TypeAlias = Mapping[Any, Any]
# What a statement run through a session gives back: the row count, and the first row when the
# statement returns rows.
Outcome: TypeAlias = "tuple[int, Row | None]"
# The verbs' statements.
Statement: TypeAlias = "sa.Select[Any] | sa.Update"


class SASession:
    """Runs the store's statements through a SQLAlchemy ``Connection`` (every dialect)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> Outcome:
        result = self.conn.execute(statement, params)
        if not result.returns_rows:
            return result.rowcount, None
        return result.rowcount, result.mappings().first()
