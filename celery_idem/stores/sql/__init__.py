"""SQL store (``db+postgresql://``, ``db+mysql://``, ``db+sqlite://``): SQLAlchemy Core.

One table (``celery_idem_records`` by default) holds one row per stored key (``prefix + key``);
the verbs are :mod:`celery_idem.stores.base`'s contract as conditional SQL. Every lease and
expiry uses the *database's* clock inside the statement (:class:`db_now`). An expired row counts
as absent but keeps its token until :meth:`SQLStore.purge_expired` deletes it, so a claim on it
still gets a higher token (:func:`token_for`). Engines run in autocommit and without pre-ping;
each verb is one statement but where docs/stores.md ("Statements") counts more per dialect. A
refused fenced verb reads the row once more to say why (not the hot path). On PostgreSQL
through psycopg 3 the statements may run on psycopg's own connection: the fast twin
(:mod:`celery_idem.stores.sql.psycopg`).

Modules, imports running down the list: ``schema`` (the table, types and clock; public),
``engine`` (URL -> engine), ``claims`` (the claim's decision and statements), ``store``
(:class:`SQLStore`: the other statements, the verbs, the errors); the store's fast twins,
imported only when it takes them: ``psycopg`` and ``taskmeta`` (Celery's result row).
"""

from __future__ import annotations

from .schema import DEFAULT_TABLE_NAME, data_type, db_now, new_metadata, records_table, text_type, token_for
from .store import SQLStore

__all__ = ["DEFAULT_TABLE_NAME", "SQLStore", "data_type", "db_now", "new_metadata", "records_table",
           "text_type", "token_for"]
