"""Celery's database result row, written in the record's own statement (PostgreSQL).

When the store is the database of Celery's database backend, the record's fenced UPDATE writes
the backend's ``celery_taskmeta`` row too::

    WITH rec  AS (UPDATE celery_idem_records SET state = 'done', ... WHERE <fenced>
                  RETURNING key),
         meta AS (INSERT INTO celery_taskmeta (id, task_id, status, result, ...)
                  SELECT nextval('task_id_sequence'), $task_id, $status, $result, ... FROM rec
                  ON CONFLICT (task_id) DO UPDATE SET status = excluded.status, ...
                  WHERE celery_taskmeta.status <> 'SUCCESS'
                  RETURNING 1)
    SELECT (SELECT count(*) FROM rec) AS recorded, (SELECT count(*) FROM meta) AS written

One transaction and one WAL flush instead of two. The row is written only when the record is
(``FROM rec``: the same fence), and never replaces a SUCCESS row. Its values come from
:mod:`celery_idem.results_db`; this module only knows the table. Imported by
``SQLStore.record_with`` only when a fold is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import sqlalchemy as sa

from ..base import BackendWrite

__all__ = ["TaskMetaWrite", "build_fold"]

#: Celery's state that a later write must not replace (its backends ignore writes after it).
_SUCCESS: Final = "SUCCESS"


@dataclass(frozen=True)
class TaskMetaWrite(BackendWrite):
    """Celery's database-backend result row, for :meth:`SQLStore.record_with` to fold.

    Attributes:
        table: Celery's result table (the backend's ``task_cls.__table__``).
        row: Column name -> value, as Celery's backend would store them (``id`` left out:
            the table's sequence gives it).
    """

    table: sa.Table | None = None
    row: Mapping[str, Any] = field(default_factory=dict)


def build_fold(record: str, key: str, meta: sa.Table, columns: tuple[str, ...],
               dialect: Any) -> tuple[str, Callable[[TaskMetaWrite], list[Any]]]:
    """The store's fenced ``record`` UPDATE (its SQL text; ``key``: the quoted key column) and
    Celery's upsert of ``columns`` of ``meta`` (``id`` from the table's sequence) as one SELECT
    of ``recorded`` (1: the record was written) and ``written`` (1: the row was inserted or
    updated; 0 beside a SUCCESS row already there).

    Returns the SQL (the record's parameters, then the row's) and the function giving a
    write's values of the row, as Celery's column types bind them (a pickled result, ...).
    """
    p = dialect.identifier_preparer
    q = p.quote
    # Typed: a NULL value must still be of its column's type in INSERT ... SELECT.
    values = {name: f"CAST(%s AS {meta.c[name].type.compile(dialect=dialect)})" for name in columns}
    id_column = meta.c.get("id")
    if id_column is not None and isinstance(id_column.default, sa.Sequence):
        # Celery's model gives ids from a sequence (the column has no server default).
        values = {"id": f"nextval('{p.format_sequence(id_column.default)}')", **values}
    updates = ", ".join(f"{q(name)} = EXCLUDED.{q(name)}" for name in columns if name != "task_id")
    sql = (f"WITH rec AS ({record} RETURNING {key}), "
           f"meta AS (INSERT INTO {p.format_table(meta)} AS m ({', '.join(q(n) for n in values)}) "
           f"SELECT {', '.join(values.values())} FROM rec ON CONFLICT ({q('task_id')}) DO UPDATE "
           # Like Celery's backend: a SUCCESS stays (a late write must not replace it).
           f"SET {updates} WHERE m.{q('status')} IS NULL OR m.{q('status')} <> '{_SUCCESS}' RETURNING 1) "
           "SELECT (SELECT count(*) FROM rec) AS recorded, (SELECT count(*) FROM meta) AS written")
    processors = [meta.c[name].type.bind_processor(dialect) for name in columns]

    def row(write: TaskMetaWrite) -> list[Any]:
        return [value if process is None else process(value)
                for process, value in zip(processors, (write.row[name] for name in columns), strict=True)]

    return sql, row
