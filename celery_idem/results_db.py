"""Celery's database result backend, its result row written in the record's own statement.

The fast twin of :class:`celery_idem.results.ResultWriter`, as :mod:`celery_idem.results_redis`.
With ``result_backend = "db+postgresql://..."`` and the store in the same database, Celery's ORM
write (a pre-ping, SELECT, INSERT, UPDATE, COMMIT) after the record's own transaction becomes
part of the record's fenced UPDATE (:mod:`.stores.sql.taskmeta`, ``SQLStore.record_with``): one
statement, one commit, and the tracer's own write is skipped.

The row's values are Celery's own: ``encode_result`` and ``_update_result`` fill a transient
instance of the backend's model, and each column is read off it. Celery creates its tables
through its own session before the first fold. Left to Celery, as for the Redis fold: eager
runs, ignored results, callbacks, chains, chords, a backend class that stores results its own
way, a store in another database or dialect. A duplicate's answer is stored by ``store_result``.
"""

from __future__ import annotations

from typing import Any, Final

from celery.states import SUCCESS

from .results import ResultWriter
from .stores.base import BackendWrite, Store

__all__ = ["DatabaseResultWriter", "database_result_writer"]

#: The backend methods between the tracer and the row (a subclass overriding one: left to Celery).
_STORE_PATH: Final = ("mark_as_done", "store_result", "_store_result", "_update_result",
                      "_get_result_meta", "encode_result", "encode")

#: URL parts that must be equal for the backend and the store to be one database and one user.
_SAME_DATABASE: Final = ("host", "database", "username", "password")


class DatabaseResultWriter(ResultWriter):
    """Builds Celery's result row for the record's statement (``folds``); never writes it: a write
    not folded (a duplicate's answer, another store) is Celery's own."""

    def __init__(self, task: Any, backend: Any) -> None:
        super().__init__(task)
        self._backend = backend
        self.folds = True
        self._table: Any = None  # Celery's result table, once it is known to exist
        self._columns: tuple[str, ...] = ()

    def build(self, request: Any, result: Any, state: str = SUCCESS) -> BackendWrite | None:
        """Celery's row of ``result`` (the value, or for ``FAILURE`` the exception) for
        ``request``, or None: leave it to Celery."""
        from .stores.sql.taskmeta import TaskMetaWrite

        if self.left_to_celery(request):
            return None
        backend = self._backend
        if self._table is None:  # Celery's own session creates its tables, once per engine
            backend.ResultSession().close()
            table = backend.task_cls.__table__
            # id comes from the table's sequence; _update_result sets the others it has.
            self._columns = tuple(c.name for c in table.columns if c.name != "id")
            self._table = table
        model = backend.task_cls(request.id)
        backend._update_result(model, backend.encode_result(result, state), state,
                               traceback=None, request=request)
        model.task_id = request.id
        row = {name: getattr(model, name, None) for name in self._columns}
        return TaskMetaWrite(key=request.id, value=b"", table=self._table, row=row)


def database_result_writer(task: Any, store: Store) -> DatabaseResultWriter | None:
    """``task``'s writer when its backend is exactly Celery's ``DatabaseBackend`` on PostgreSQL
    and ``store`` a :class:`SQLStore` of the same database and user; else None (left to Celery)."""
    try:
        from celery.backends.database import DatabaseBackend
        from sqlalchemy.engine import make_url

        from .stores.sql import SQLStore
    except ImportError:  # no SQLAlchemy: neither the backend nor the store can exist
        return None
    backend = task.backend
    cls = type(backend)
    if not hasattr(DatabaseBackend, "_update_result"):
        return None  # a Celery without it: results are left to Celery (compat.PRIVATE_NAMES)
    if not isinstance(backend, DatabaseBackend) or any(
            getattr(cls, name, None) is not getattr(DatabaseBackend, name) for name in _STORE_PATH):
        return None
    if type(store) is not SQLStore or store.dialect != "postgresql":
        return None
    try:
        theirs = make_url(backend.url)
    except Exception:  # a URL Celery accepts and SQLAlchemy cannot parse: not ours to judge
        return None
    ours = store.url
    if theirs.get_backend_name() != "postgresql" or (theirs.port or 5432) != (ours.port or 5432) \
            or any(getattr(theirs, part) != getattr(ours, part) for part in _SAME_DATABASE):
        return None
    return DatabaseResultWriter(task, backend)

