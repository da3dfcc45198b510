"""SQL store (``db+postgresql://``, ``db+mysql://``, ``db+sqlite://``): SQLAlchemy Core.

One row per stored key (``prefix + key``) in one table (``celery_idem_records`` by default);
the verbs are the contract as conditional SQL on the *database's* clock (:class:`db_now`). An
expired row counts as absent but keeps its token until :meth:`SQLStore.purge_expired` deletes
it. Engines run in autocommit without pre-ping; each verb is one statement but where
docs/stores.md ("Statements") counts more.

Modules, imports running down the list: ``schema`` (the table, types and clock; public),
``engine`` (URL -> engine), ``store`` (:class:`SQLStore`; its statements are
:mod:`celery_idem.stores.sql_records`' and :mod:`celery_idem.stores.sql_intents`', shared with
the Django store); its fast twins, imported only when taken: ``psycopg`` (the statements on
psycopg 3's own connection) and ``taskmeta`` (Celery's result row).
"""

from __future__ import annotations

from .schema import DEFAULT_TABLE_NAME, data_type, db_now, new_metadata, records_table, text_type
from .store import SQLStore

__all__ = ["DEFAULT_TABLE_NAME", "SQLStore", "data_type", "db_now", "new_metadata", "records_table",
           "text_type"]
