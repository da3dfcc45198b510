"""The SQL store's schema (celery_idem/stores/sql/schema.py), on PostgreSQL, MariaDB and SQLite.

The tables are created on the real servers (tests/conftest.py's fixtures; a server that does not
answer skips locally and fails in CI), each test on tables of its own, dropped afterwards: the
key columns compare byte for byte, results take more than 64 KiB, the database clock moves
inside a transaction, and a table of an earlier version is brought to this schema.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_idem.exceptions import ImproperlyConfigured
from celery_idem.stores.sql.engine import build_engine, sqlalchemy_url
from celery_idem.stores.sql.schema import (
    DEFAULT_TABLE_NAME,
    add_missing_columns,
    data_type,
    db_now,
    intent_tables,
    new_metadata,
    records_table,
    text_type,
)
from tests.conftest import store_kinds

# SQLAlchemy and the database drivers only: no Celery, kombu or redis-py (make test-compat).
pytestmark = pytest.mark.celery_independent


@pytest.fixture(params=store_kinds("postgresql", "mysql", "sqlite"))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    if request.param == "sqlite":
        url = f"db+sqlite:///{tmp_path / 'idem.db'}"
    else:
        url = "db+" + request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")
    engine = build_engine(sqlalchemy_url(url), {})
    yield engine
    engine.dispose()


@pytest.fixture
def table(engine: sa.Engine) -> Iterator[sa.Table]:
    """This test's records table (with its intents and watermarks), created; dropped after."""
    table = records_table(f"t_{uuid.uuid4().hex[:12]}")
    intent_tables(table)
    yield table
    table.metadata.drop_all(engine)


def _row(key: str, **values: object) -> dict[str, object]:
    return {"key": key, "state": "done", "token": 1, "owner": "", "task_id": "", "attempt": 0,
            "updated": 0.0, "expires": 0.0, **values}


# -- the tables -------------------------------------------------------------------------------


def test_records_table_has_the_records_columns_in_a_metadata_of_its_own() -> None:
    one, other = records_table(), records_table("mine")
    assert one.name == DEFAULT_TABLE_NAME == "celery_idem_records" and other.name == "mine"
    assert one.metadata is not other.metadata
    assert [c.name for c in one.c] == [
        "key", "state", "token", "owner", "task_id", "attempt", "lease_expires", "payload_hash",
        "content_type", "data", "updated", "expires", "claim_id"]
    assert [c.name for c in one.primary_key] == ["key"]
    assert {c.name for c in one.c if c.nullable} == {
        "lease_expires", "payload_hash", "content_type", "data", "claim_id"}


def test_the_intent_tables_are_named_after_the_records_and_created_with_them(
    engine: sa.Engine, table: sa.Table
) -> None:
    intents, watermarks = (table.metadata.tables[f"{table.name}_{t}"] for t in ("intents", "watermarks"))
    assert [c.name for c in intents.primary_key] == ["key"]
    assert [c.name for c in watermarks.primary_key] == ["queue"]
    table.metadata.create_all(engine)
    names = set(sa.inspect(engine).get_table_names())
    assert {table.name, intents.name, watermarks.name} <= names


def test_indexes_are_named_ix_table_column(engine: sa.Engine, table: sa.Table) -> None:
    table.metadata.create_all(engine)
    inspector = sa.inspect(engine)
    assert {i["name"] for i in inspector.get_indexes(table.name)} == {
        f"ix_{table.name}_state", f"ix_{table.name}_expires"}
    assert {i["name"] for i in inspector.get_indexes(f"{table.name}_intents")} == {
        f"ix_{table.name}_intents_deadline"}
    assert new_metadata().naming_convention["ix"] == "ix_%(table_name)s_%(column_0_name)s"


# -- the column types -------------------------------------------------------------------------


def test_key_text_compares_byte_for_byte(engine: sa.Engine, table: sa.Table) -> None:
    table.metadata.create_all(engine)
    # MySQL's default collations would make these one key (case, accents, trailing spaces)
    keys = ["K", "k", "K ", "K  ", "é", "e\u0301", "E", "ß", "ss"]
    with engine.connect() as conn:
        conn.execute(sa.insert(table), [_row(k) for k in keys])
        for k in keys:
            found = conn.execute(sa.select(table.c.key).where(table.c.key == k)).scalars().all()
            assert found == [k], (k, found)
        ordered = conn.execute(sa.select(table.c.key).order_by(table.c.key)).scalars().all()
    assert ordered == sorted(keys, key=lambda k: k.encode())  # binary order, as Python's on UTF-8


def test_text_type_on_mysql_takes_the_no_pad_binary_collation() -> None:
    from sqlalchemy.dialects import mysql

    dialect = mysql.dialect()
    dialect.is_mariadb = True
    assert str(text_type(255).compile(dialect=dialect)) == (
        "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin")
    dialect = mysql.dialect()
    dialect.server_version_info = (8, 0, 36)
    assert str(text_type(64).compile(dialect=dialect)).endswith("COLLATE utf8mb4_0900_bin")


def test_data_holds_a_result_over_64_kib_byte_for_byte(engine: sa.Engine, table: sa.Table) -> None:
    table.metadata.create_all(engine)
    data = bytes(range(256)) * 1024 + b"\x00"  # 256 KiB and a NUL: a MySQL BLOB stops at 64 KiB
    with engine.connect() as conn:
        conn.execute(sa.insert(table), [_row("big", data=data)])
        assert conn.execute(sa.select(table.c.data)).scalar_one() == data
    assert isinstance(data_type(), sa.LargeBinary)


def test_db_now_is_the_servers_clock_and_moves_inside_a_transaction(engine: sa.Engine) -> None:
    with engine.connect() as conn, conn.begin():
        first = conn.execute(sa.select(db_now())).scalar_one()
        time.sleep(0.05)
        second = conn.execute(sa.select(db_now())).scalar_one()
    assert isinstance(first, float)
    assert abs(first - time.time()) < 2.0  # the servers run on this machine, in epoch seconds
    assert 0.04 < second - first < 2.0  # not frozen at the transaction's start (PostgreSQL's now())


# -- a table of an earlier version ------------------------------------------------------------


def _old(table: sa.Table, without: set[str]) -> sa.Table:
    """``table`` as an earlier version made it: without the columns ``without``."""
    return sa.Table(table.name, sa.MetaData(), *(
        sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
        for c in table.c if c.name not in without))


def _columns(engine: sa.Engine, table: sa.Table) -> set[str]:
    return {c["name"] for c in sa.inspect(engine).get_columns(table.name)}


def test_missing_columns_are_added_and_the_rows_kept(engine: sa.Engine, table: sa.Table) -> None:
    old = _old(table, {"claim_id", "payload_hash"})
    old.create(engine)
    with engine.connect() as conn:
        conn.execute(sa.insert(old), [_row("old", token=7)])
    add_missing_columns(engine, table)
    assert _columns(engine, table) == {c.name for c in table.c}
    with engine.connect() as conn:
        row = conn.execute(sa.select(table)).mappings().one()
        assert (row["key"], row["token"], row["claim_id"], row["payload_hash"]) == ("old", 7, None, None)
        conn.execute(sa.insert(table), [_row("new", claim_id="AAAAAAAA", payload_hash="h")])
    add_missing_columns(engine, table)  # nothing left to add: no change, no error
    assert _columns(engine, table) == {c.name for c in table.c}


@pytest.mark.parametrize("engine", store_kinds("mysql"), indirect=True)
def test_a_mysql_table_in_a_pad_space_collation_is_changed_to_the_byte_for_byte_one(
    engine: sa.Engine, table: sa.Table
) -> None:
    old = sa.Table(table.name, sa.MetaData(), *(
        sa.Column(c.name, sa.dialects.mysql.VARCHAR(c.type.length, charset="utf8mb4",
                                                   collation="utf8mb4_bin")
                  if isinstance(c.type, sa.String) else c.type,
                  primary_key=c.primary_key, nullable=c.nullable)
        for c in table.c if c.name != "claim_id"))
    old.create(engine)
    add_missing_columns(engine, table)
    with engine.connect() as conn:
        collations: dict[str, str] = dict(conn.execute(sa.text(
            "SELECT COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t AND COLLATION_NAME IS NOT NULL"),
            {"t": table.name}).all())
        nullable: dict[str, str] = dict(conn.execute(sa.text(
            "SELECT COLUMN_NAME, IS_NULLABLE FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = :t"), {"t": table.name}).all())
        conn.execute(sa.insert(table), [_row("K"), _row("K ")])  # two keys now
    assert set(collations) == {c.name for c in table.c if isinstance(c.type, sa.String)}
    assert set(collations.values()) == {"utf8mb4_nopad_bin"}, collations
    assert {n for n, v in nullable.items() if v == "YES"} == {c.name for c in table.c if c.nullable}


def test_a_change_the_user_may_not_make_is_improperly_configured_with_the_ddl(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ro.db"
    table = records_table(f"t_{uuid.uuid4().hex[:12]}")
    writable = build_engine(sqlalchemy_url(f"db+sqlite:///{path}"), {})
    _old(table, {"claim_id"}).create(writable)
    writable.dispose()
    read_only = build_engine(sqlalchemy_url(f"sqlite:///file:{path}?mode=ro&uri=true"), {})
    try:
        with pytest.raises(ImproperlyConfigured, match=rf"table '{table.name}' .* needs a change "
                                                       rf"it cannot make: .*readonly.*; run: ALTER "
                                                       rf"TABLE {table.name} ADD COLUMN claim_id"):
            add_missing_columns(read_only, table)
    finally:
        read_only.dispose()


def test_a_column_another_worker_added_meanwhile_is_no_error(tmp_path: Path) -> None:
    engine = build_engine(sqlalchemy_url(f"db+sqlite:///{tmp_path / 'race.db'}"), {})
    table = records_table(f"t_{uuid.uuid4().hex[:12]}")
    _old(table, {"claim_id"}).create(engine)
    other = sa.create_engine(engine.url)  # the other worker
    raced = threading.Event()

    def the_other_worker_first(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("ALTER TABLE") and not raced.is_set():
            raced.set()
            with other.connect() as theirs:
                theirs.exec_driver_sql(statement)
                theirs.commit()

    sa.event.listen(engine, "before_cursor_execute", the_other_worker_first)
    try:
        add_missing_columns(engine, table)  # its own ALTER fails: duplicate column
        assert raced.is_set()
        assert "claim_id" in _columns(engine, table)
    finally:
        other.dispose()
        engine.dispose()
