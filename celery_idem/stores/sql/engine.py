"""Building the store's SQLAlchemy engine: URLs, driver fallbacks, pool settings, forks."""

from __future__ import annotations

import importlib.util
import os
import time
import weakref
from collections.abc import Mapping
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Engine, make_url

from ...exceptions import ImproperlyConfigured

__all__ = ["BACKENDS", "build_engine", "importable", "sqlalchemy_url"]

# URL backend -> (SQLAlchemy's default DBAPI module, the fallback driver when only it is installed).
DRIVER_FALLBACKS: Final = {"postgresql": ("psycopg2", "psycopg"), "mysql": ("MySQLdb", "pymysql"),
                           "mariadb": ("mariadb", "pymysql")}
BACKENDS: Final = ("postgresql", "mysql", "mariadb", "sqlite")
# pip package of a DBAPI module, where its name is not the module's.
_DRIVER_PACKAGES: Final = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]",
                           "MySQLdb": "mysqlclient", "mysql": "mysql-connector-python"}

# Workers fork after the store is built: a child must never reuse the parent's sockets. Held
# weakly so a closed store can be collected (an at-fork hook cannot be unregistered).
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    for engine in list(_ENGINES):
        engine.dispose(close=False)  # drop the parent's connections without closing them


os.register_at_fork(after_in_child=_forget_inherited_connections)


def sqlalchemy_url(url: str) -> URL:
    """``db+<dialect>[+driver]://...`` (or a plain SQLAlchemy URL) -> the URL to connect to."""
    if url[:3].lower() == "db+":
        url = url[3:]  # like Celery's database result backend
    try:
        sa_url = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise ImproperlyConfigured(f"celery_idem cannot parse the SQL store URL: {exc}") from exc
    backend = sa_url.get_backend_name()
    if backend not in BACKENDS:
        raise ImproperlyConfigured(f"the SQL store supports {', '.join(BACKENDS)}, not {backend!r}")
    if "+" not in sa_url.drivername and backend in DRIVER_FALLBACKS:
        default_module, fallback = DRIVER_FALLBACKS[backend]
        if not importable(default_module) and importable(fallback):
            sa_url = sa_url.set(drivername=f"{backend}+{fallback}")
    return sa_url


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def build_engine(sa_url: URL, engine_options: Mapping[str, Any]) -> Engine:
    backend = sa_url.get_backend_name()
    options: dict[str, Any] = {
        # No pre-ping (it doubles round trips): a closed connection fails as a disconnect,
        # which the gate retries. Recycled before the usual idle limits (MySQL, PgBouncer).
        "pool_pre_ping": False, "pool_recycle": 1800,
        # Each verb is one statement or opens its own transaction: no BEGIN/COMMIT round trips,
        # nor a ROLLBACK on check-in (but on SQLite, for a failed BEGIN IMMEDIATE).
        "isolation_level": "AUTOCOMMIT", "skip_autocommit_rollback": backend != "sqlite",
        **engine_options}
    if backend == "sqlite":
        # Several worker processes share the file: wait for the write lock, not fail at once.
        options["connect_args"] = {"timeout": 30.0, **engine_options.get("connect_args", {})}
    try:
        engine = sa.create_engine(sa_url, **options)
    except ModuleNotFoundError as exc:  # SQLAlchemy imports the URL's driver here
        module = (exc.name or "").split(".")[0]
        raise ImproperlyConfigured(
            f"the db+{backend}:// store needs the database driver {module!r} for "
            f"{sa_url.drivername!r}, which is not installed: pip install "
            f"'{_DRIVER_PACKAGES.get(module, module or 'the driver')}' (celery-idem[sql] brings "
            f"SQLAlchemy, not the driver)") from exc
    if backend == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_on_connect)
    elif backend in ("mysql", "mariadb"):
        sa.event.listen(engine, "connect", _mysql_on_connect)
    _ENGINES.add(engine)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # WAL lets readers run while one process writes. Switching needs the file to itself and gets
    # "database is locked" at once (no busy timeout): retry for up to 5 s.
    deadline = time.monotonic() + 5.0
    delay = 0.005
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode=WAL").close()
            return
        except Exception as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _mysql_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # UNIX_TIMESTAMP(NOW(6)) goes through the session time zone: UTC has no DST fold.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET time_zone = '+00:00'")
    finally:
        cursor.close()

