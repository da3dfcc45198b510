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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ..base import BackendWrite

__all__ = ["TaskMetaWrite", "build_fold", "fold_params"]

#: Celery's state that a later write must not replace (its backends ignore writes after it).
_SUCCESS: Final = "SUCCESS"

# Per-call values are idem_* parameters (the fast path inlines every other bind as a
# constant): the record's own, and the row's as idem_meta_<column>.
_META: Final = "idem_meta_"


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


def build_fold(record: sa.TextualSelect, meta: sa.Table, columns: tuple[str, ...]) -> sa.Select[Any]:
    """The store's fenced ``record`` UPDATE (``RETURNING`` the key) and Celery's upsert of ``columns``
    (``idem_meta_<name>`` parameters; ``id`` from the table's sequence) of ``meta`` as one
    SELECT of ``recorded`` (1: the record was written) and ``written`` (1: the row was
    inserted or updated; 0 beside a SUCCESS row already there)."""
    rec = record.cte("rec")
    values: dict[str, Any] = {
        name: sa.bindparam(_META + name, type_=meta.c[name].type) for name in columns
    }
    id_column = meta.c.get("id")
    if id_column is not None and isinstance(id_column.default, sa.Sequence):
        # Celery's model gives ids from a sequence (the column has no server default).
        values = {"id": id_column.default.next_value(), **values}
    insert = pg_insert(meta).from_select(list(values), sa.select(*values.values()).select_from(rec))
    upsert = insert.on_conflict_do_update(
        index_elements=[meta.c.task_id],
        set_={name: insert.excluded[name] for name in columns if name != "task_id"},
        # Like Celery's backend: a SUCCESS stays (a late write must not replace it).
        where=sa.or_(meta.c.status.is_(None), meta.c.status != _SUCCESS),
    ).returning(sa.literal(1).label("one")).cte("meta")
    count = sa.func.count
    return sa.select(
        sa.select(count()).select_from(rec).scalar_subquery().label("recorded"),
        sa.select(count()).select_from(upsert).scalar_subquery().label("written"))


def fold_params(write: TaskMetaWrite) -> dict[str, Any]:
    """The per-call ``idem_meta_*`` values of ``write``."""
    return {_META + name: value for name, value in write.row.items()}
