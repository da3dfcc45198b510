"""Building the SQL store's engine (celery_idem/stores/sql/engine.py): URLs, drivers, settings.

URL parsing and driver choice need no server; the settings each connection gets (autocommit,
UTC on MySQL/MariaDB, WAL on SQLite) and the forked child's own connections are checked on the
real servers (tests/conftest.py's fixtures; a server that does not answer skips locally and
fails in CI).
"""

from __future__ import annotations

import gc
import multiprocessing
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores.sql import engine as engine_mod
from celery_idem.stores.sql.engine import BACKENDS, build_engine, importable, sqlalchemy_url
from tests.conftest import store_kinds

from .support import DEADLINE

# SQLAlchemy and the database drivers only: no Celery, kombu or redis-py (make test-compat).
pytestmark = pytest.mark.celery_independent


@pytest.fixture(params=store_kinds("postgresql", "mysql", "sqlite"))
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"db+sqlite:///{tmp_path / 'idem.db'}"
    return "db+" + str(request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url"))


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    engine = build_engine(sqlalchemy_url(url), {})
    yield engine
    engine.dispose()


# -- URLs and drivers -------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "driver"), [
    ("db+postgresql+psycopg://root@h/db", "postgresql+psycopg"),
    ("DB+mysql+pymysql://root@h/db", "mysql+pymysql"),  # the prefix in any case
    ("postgresql+psycopg://root@h/db", "postgresql+psycopg"),  # a plain SQLAlchemy URL
    ("db+sqlite:///x.db", "sqlite"),
    ("db+mariadb+pymysql://root@h/db", "mariadb+pymysql"),
])
def test_a_url_with_a_driver_keeps_it_and_loses_the_db_prefix(given: str, driver: str) -> None:
    sa_url = sqlalchemy_url(given)
    assert sa_url.drivername == driver
    assert sa_url.get_backend_name() in BACKENDS


def test_a_url_without_a_driver_falls_back_to_an_installed_one() -> None:
    pg = sqlalchemy_url("db+postgresql://root@127.0.0.1/test")
    my = sqlalchemy_url("db+mysql://root@127.0.0.1/test")
    assert pg.drivername == ("postgresql" if importable("psycopg2") else "postgresql+psycopg")
    assert my.drivername == ("mysql" if importable("MySQLdb") else "mysql+pymysql")


@pytest.mark.parametrize(("installed", "driver"), [
    ({"psycopg2", "psycopg"}, "postgresql"),  # SQLAlchemy's default is there: left to it
    ({"psycopg"}, "postgresql+psycopg"),
    (set(), "postgresql"),  # neither: build_engine names the package to install
])
def test_the_fallback_is_taken_only_when_the_default_driver_is_missing(
    monkeypatch: pytest.MonkeyPatch, installed: set[str], driver: str
) -> None:
    monkeypatch.setattr(engine_mod, "importable", lambda module: module in installed)
    assert sqlalchemy_url("db+postgresql://root@h/db").drivername == driver


@pytest.mark.parametrize("given", ["db+oracle://u@h/db", "mssql+pyodbc://u@h/db"])
def test_a_database_the_store_does_not_support_is_improperly_configured(given: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"supports postgresql, mysql, mariadb, sqlite, "
                                                   r"not '(oracle|mssql)'"):
        sqlalchemy_url(given)


@pytest.mark.parametrize("given", ["db+", "not a url", "db+://"])
def test_a_url_sqlalchemy_cannot_parse_is_improperly_configured(given: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="cannot parse the SQL store URL"):
        sqlalchemy_url(given)


def test_importable_finds_a_module_without_importing_it() -> None:
    assert importable("sqlalchemy") and importable("json")
    assert not importable(f"no_such_module_{uuid.uuid4().hex}")


@pytest.mark.parametrize(("url", "package"), [
    ("postgresql+psycopg2://root@127.0.0.1/test", "psycopg2-binary"),
    ("mysql+mysqldb://root@127.0.0.1/test", "mysqlclient"),
])
def test_a_missing_driver_is_improperly_configured_naming_the_package(url: str, package: str) -> None:
    module = {"psycopg2-binary": "psycopg2", "mysqlclient": "MySQLdb"}[package]
    if importable(module):
        pytest.skip(f"{module} is installed here")
    with pytest.raises(ImproperlyConfigured, match=rf"needs the database driver '{module}'.*"
                                                   rf"pip install '{package}'") as info:
        build_engine(sa.make_url(url), {})
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


# -- the engine's settings --------------------------------------------------------------------


def test_the_pool_neither_pings_nor_keeps_connections_past_30_minutes(engine: sa.Engine) -> None:
    pool: Any = engine.pool
    assert (pool._pre_ping, pool._recycle) == (False, 1800)
    # Autocommit connections skip the ROLLBACK on check-in, but on SQLite (BEGIN IMMEDIATE)
    assert engine.dialect.skip_autocommit_rollback is (engine.dialect.name != "sqlite")


def test_the_callers_engine_options_win(tmp_path: Path) -> None:
    engine = build_engine(sqlalchemy_url(f"db+sqlite:///{tmp_path / 'x.db'}"),
                          {"pool_recycle": 5, "pool_pre_ping": True})
    try:
        pool: Any = engine.pool
        assert (pool._pre_ping, pool._recycle) == (True, 5)
    finally:
        engine.dispose()


def test_a_write_is_committed_by_itself(engine: sa.Engine) -> None:
    table = f"t_{uuid.uuid4().hex[:12]}"
    other = sa.create_engine(engine.url)  # a separate pool: another worker
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {table} (n INTEGER)")
            conn.exec_driver_sql(f"INSERT INTO {table} (n) VALUES (1)")  # no commit() follows
            with other.connect() as seen:
                assert seen.exec_driver_sql(f"SELECT n FROM {table}").scalars().all() == [1]
    finally:
        other.dispose()
        with engine.connect() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")


@pytest.mark.parametrize("url", store_kinds("mysql"), indirect=True)
def test_every_mysql_connection_is_on_utc(engine: sa.Engine) -> None:
    # A pooled connection and a fresh one alike: the listener runs on every connect
    for _ in range(2):
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT @@session.time_zone").scalar() == "+00:00"
        engine.dispose()


@pytest.mark.parametrize("url", store_kinds("sqlite"), indirect=True)
def test_sqlite_connections_use_wal_and_wait_30_s_for_the_write_lock(
    url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    seen: list[dict[str, Any]] = []
    create = sa.create_engine

    def spy(sa_url: Any, **options: Any) -> sa.Engine:
        seen.append(options)
        return create(sa_url, **options)

    monkeypatch.setattr(sa, "create_engine", spy)
    build_engine(sqlalchemy_url(url), {"connect_args": {"check_same_thread": False}}).dispose()
    assert seen[0]["connect_args"] == {"timeout": 30.0, "check_same_thread": False}


def test_switching_sqlite_to_wal_waits_for_a_reader_to_finish(tmp_path: Path) -> None:
    path = tmp_path / "busy.db"
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    reader.execute("CREATE TABLE t (n INTEGER)")
    reader.execute("BEGIN")
    reader.execute("SELECT * FROM t").fetchall()  # a shared lock: WAL cannot be switched on now
    released = threading.Timer(0.3, reader.execute, ["COMMIT"])
    engine = build_engine(sqlalchemy_url(f"db+sqlite:///{path}"), {})
    try:
        started = time.monotonic()
        released.start()
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert 0.2 < time.monotonic() - started < 5.0
    finally:
        released.join(DEADLINE)
        reader.close()
        engine.dispose()


class _Locked:
    """A DBAPI connection whose ``execute`` always raises ``error``."""

    def __init__(self, error: str) -> None:
        self.error, self.calls = error, 0

    def execute(self, sql: str) -> Any:
        self.calls += 1
        raise sqlite3.OperationalError(self.error)


def test_a_lock_that_stays_fails_the_wal_switch_after_5_s(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]  # a clock of the test's own, moved by the waits only: no real sleeping
    monkeypatch.setattr(engine_mod, "time", SimpleNamespace(
        monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s)))
    conn = _Locked("database is locked")
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        engine_mod._sqlite_on_connect(conn, None)
    assert 4.8 < clock[0] <= 5.0 and conn.calls > 10  # retried with back-off up to the deadline
    other = _Locked("disk I/O error")
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        engine_mod._sqlite_on_connect(other, None)
    assert other.calls == 1  # any other error at once


# -- forks and collection ---------------------------------------------------------------------


def _backend_pid(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


_FORKED: sa.Engine | None = None


def _child(results: Any) -> None:
    assert _FORKED is not None
    results.put(_backend_pid(_FORKED))


def test_a_forked_child_opens_its_own_connections_and_leaves_the_parents(pg_url: str) -> None:
    global _FORKED
    engine = build_engine(sqlalchemy_url("db+" + pg_url), {"pool_size": 1})
    try:
        parent = _backend_pid(engine)  # now idle in the pool, inherited by the child
        _FORKED = engine
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_child, args=(results,))
        child.start()
        pid = results.get(timeout=DEADLINE)
        child.join(DEADLINE)
        assert child.exitcode == 0
        assert pid != parent
        assert _backend_pid(engine) == parent  # the child did not close the parent's socket
    finally:
        _FORKED = None
        engine.dispose()


def test_a_built_engine_can_be_collected(tmp_path: Path) -> None:
    engine = build_engine(sqlalchemy_url(f"db+sqlite:///{tmp_path / 'x.db'}"), {})
    assert engine in engine_mod._ENGINES  # known to the at-fork hook
    ref = weakref.ref(engine)
    engine.dispose()
    del engine
    gc.collect()
    assert ref() is None
