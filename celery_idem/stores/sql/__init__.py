"""SQL store (``db+postgresql://``, ``db+mysql://``, ``db+sqlite://``): SQLAlchemy Core.

One table (``celery_idem_records`` by default) holds one row per stored key (``prefix + key``).
The verbs are the contract of :mod:`celery_idem.stores.base`, with the semantics of
:class:`~celery_idem.stores.memory.MemoryStore`, translated into conditional SQL:

* every lease and expiry computation uses the *database's* clock inside the statement that
  needs it (:class:`db_now`), so workers with skewed clocks agree on who holds a key;
* a row whose ``expires`` has passed counts as absent everywhere, but it keeps its token until
  :meth:`SQLStore.purge_expired` deletes it, so a claim on it still gets a higher token;
* a taking claim's token is :func:`token_for` (:func:`celery_idem.stores.base.next_token` in
  SQL), and its random ``claim_id`` is checked with the token by the fenced verbs;
* engines run in autocommit: each verb is one statement, except as the table below says.

Statements per verb (each is one round trip; the engine runs without pre-ping)::

    verb      PostgreSQL              SQLite                         MySQL / MariaDB
    claim     1 (CTE upsert)          BEGIN IMMEDIATE + 1..2 + COMMIT 1 (not taken) / 2 (taken)
    record    1                       1                              1
    release   1                       1                              1
    renew     1 (RETURNING)           1 (RETURNING)                  2 (UPDATE, SELECT)
    get       1                       1                              1

A fenced verb that is refused reads the row once more to say why (not the hot path).
PostgreSQL through psycopg 3 may run the same statements on psycopg's own connection: an
acceleration (:mod:`celery_idem.accel.sql_psycopg`, off with ``CELERY_IDEM_ACCELERATE=0``).

The package, one module per job (imports run down this list, never up)::

    schema      the records table, column types, the database clock (public helpers)
    predicates  a claim's arguments, and its decision as one SQL CASE
    engine      URL -> engine: driver fallbacks, pool settings, fork safety
    session     running statements: SQLAlchemy's Connection (psycopg's directly: accel)
    statements  the fenced writes' and the read's statements, built once per table
    claims      the claim strategies (one PostgreSQL statement; decide-then-write)
    store       SQLStore: the verbs, errors -> StoreUnavailable, rows -> records
"""

from __future__ import annotations

from .schema import DEFAULT_TABLE_NAME, data_type, db_now, new_metadata, records_table, text_type, token_for
from .store import SQLStore

__all__ = ["DEFAULT_TABLE_NAME", "SQLStore", "data_type", "db_now", "new_metadata", "records_table",
           "text_type", "token_for"]
