"""The shop's Celery app, configured from environment variables only.

Every variable the app reads is in :data:`ENV` (with its default); ``docker-compose.yml`` sets
the same names. The defaults need no server: kombu's SQLAlchemy transport on SQLite for the
broker, Celery's database backend on SQLite for results, and the idempotency records in the
result backend (``celery_idem``'s SQL store).

Run a worker with::

    celery -A example_app.celery_app worker -P threads -c 16 -l INFO
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
from pathlib import Path

from celery import Celery

_DATA = Path(tempfile.gettempdir()) / "celery-idem-example"

#: Every environment variable this app reads, and its default.
ENV: dict[str, str] = {
    # Broker and result backend (also Celery's own names for them).
    "CELERY_BROKER_URL": f"sqla+sqlite:///{_DATA}/broker.sqlite",
    "CELERY_RESULT_BACKEND": f"db+sqlite:///{_DATA}/results.sqlite",
    # The idempotency store (empty: the result backend) and its key prefix.
    "CELERY_IDEM_STORE": "",
    "CELERY_IDEM_KEY_PREFIX": "example:",
    # The queue the tools are sent to and the worker consumes.
    "EXAMPLE_QUEUE": "example",
    # Where the provider (payments, e-mail and shipping APIs) listens.
    "EXAMPLE_PAYMENTS_URL": "http://127.0.0.1:8080",
    # Prefix of the idempotency records' table (and the provider's tables), to share one
    # database. Celery's and kombu's own tables keep their names: their index names are fixed,
    # so a renamed copy would collide with the original's indexes on PostgreSQL.
    "EXAMPLE_TABLE_PREFIX": "",
    # A file that receives one line per celery_idem decision (the demo reads it).
    "EXAMPLE_EVENT_LOG": "",
    # Seconds between polls of kombu's SQLAlchemy transport (its built-in default is 1 s).
    "EXAMPLE_POLL_INTERVAL": "0.1",
}


def setting(name: str) -> str:
    """The value of one of :data:`ENV` (the environment wins over the default)."""
    return os.environ.get(name) or ENV[name]


def _sqlite_path(url: str) -> Path | None:
    """The file of a ``...sqlite:///path`` URL, or None."""
    head, sep, path = url.partition(":///")
    if not sep or not head.endswith("sqlite") or not path:
        return None
    return Path(path.split("?", 1)[0])


def _prepare_sqlite(url: str) -> None:
    """Create the file's directory and switch the file to WAL (several processes share it)."""
    path = _sqlite_path(url)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path, timeout=30) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
    conn.close()


broker_url = setting("CELERY_BROKER_URL")
backend_url = setting("CELERY_RESULT_BACKEND")
store_url = setting("CELERY_IDEM_STORE") or backend_url
table_prefix = setting("EXAMPLE_TABLE_PREFIX")
for _url in {broker_url, backend_url, store_url}:
    _prepare_sqlite(_url)

app = Celery("shop", broker=broker_url, backend=backend_url,
             include=["example_app.tasks", "example_app.naive", "example_app.saga"])
app.conf.update(
    task_default_queue=setting("EXAMPLE_QUEUE"),
    idempotency_key_prefix=setting("CELERY_IDEM_KEY_PREFIX"),
    idempotency_store=store_url,
    worker_prefetch_multiplier=1,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
)

if broker_url.startswith(("sqla+", "sqlalchemy+")):
    # Options of kombu's SQLAlchemy transport go to create_engine(); ``polling_interval`` is not
    # one (putting it there makes the worker crash), so set it on the transport class instead.
    from kombu.transport import sqlalchemy as _kombu_sqla

    _kombu_sqla.Transport.polling_interval = float(setting("EXAMPLE_POLL_INTERVAL"))
    if _sqlite_path(broker_url):
        app.conf.broker_transport_options = {"connect_args": {"timeout": 30}}

if backend_url.startswith("db+") and _sqlite_path(backend_url):
    app.conf.database_engine_options = {"connect_args": {"timeout": 30}}

if store_url.startswith("db+") and table_prefix:
    app.conf.idempotency_store_options = {"table_name": f"{table_prefix}celery_idem_records"}

_event_log = setting("EXAMPLE_EVENT_LOG")
if _event_log:
    # One line per gate decision ("celery_idem claimed key=... task_id=... token=..."); most
    # decisions log at DEBUG, so this logger is set to DEBUG.
    _handler = logging.FileHandler(_event_log)
    _handler.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    _idem_logger = logging.getLogger("celery_idem")
    _idem_logger.addHandler(_handler)
    _idem_logger.setLevel(logging.DEBUG)
