"""SQL store (``db+postgresql://``, ``db+mysql://``, ``db+sqlite://``): SQLAlchemy Core.

One table (``celery_idem_records`` by default) holds one row per stored key (``prefix + key``).
The verbs are the contract of :mod:`celery_idem.stores.base`, with the semantics of
:class:`~celery_idem.stores.memory.MemoryStore`, translated into conditional SQL:

* every lease and expiry computation uses the *database's* clock inside the statement that
  needs it (:class:`db_now`), so workers with skewed clocks agree on who holds a key;
* a row whose ``expires`` has passed counts as absent everywhere, but it keeps its token until
  :meth:`SQLStore.purge_expired` deletes it, so a claim on it still gets a higher token;
* a taking claim's token is ``max(previous + 1, database clock in µs)`` (:func:`token_for`,
  the scheme of :func:`celery_idem.stores.base.next_token`), so even a claim on a deleted or
  purged row gets a token above the lost one; each taking claim also stores a random
  ``claim_id``, which ``record``, ``release`` and ``renew`` check with the token;
* engines run in autocommit: each verb is one self-contained statement, except where a dialect
  cannot say what it needs in one (see :meth:`SQLStore.claim` and :meth:`SQLStore.renew`).

Statements per verb (each is one round trip; the engine runs without pre-ping)::

    verb      PostgreSQL              SQLite                         MySQL / MariaDB
    claim     1 (CTE upsert)          BEGIN IMMEDIATE + 1..2 + COMMIT 1 (not taken) / 2 (taken)
    record    1                       1                              1
    release   1                       1                              1
    renew     1 (RETURNING)           1 (RETURNING)                  2 (UPDATE, SELECT)
    get       1                       1                              1

A claim that loses a race against a concurrent first claim of the same key runs once more
(nothing was written the first time); a fenced verb that is refused reads the row once more to
say why. Neither is on the hot path.

PostgreSQL through psycopg 3 (the default driver when psycopg2 is not installed) takes a fast
path: each verb's statement is built and compiled once, then run on the pooled psycopg
connection itself as a server-side prepared statement with plain tuples, skipping SQLAlchemy's
per-call compile-cache lookup, parameter processing and result objects (they cost more client
CPU than the round trip). The statement's constants are written into its SQL and its
placeholders numbered (``$1``) once, so each call sends only its own values, as they are
(see :class:`~celery_idem.accel.sql_psycopg.RawStatement`; an acceleration, off with
``CELERY_IDEM_ACCELERATE=0``). Same statements, same single
round trip, same exceptions. Every other driver and dialect runs the same pre-built
statements through a SQLAlchemy ``Connection``.

A PostgreSQL claim that finds the key DONE, FAILED or MISMATCH (a duplicate) locks nothing
and writes nothing, so it costs no WAL flush at commit (see
:func:`~celery_idem.stores.sql.claims.build_pg_claim`).

The package, one module per job (imports run down this list, never up)::

    schema      the records table, column types, the database clock (public helpers)
    predicates  the claim's decision as named SQL conditions; a claim's arguments
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
