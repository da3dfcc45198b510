"""Fixtures of the receipts tests: a real business database per test (SQLite file, PostgreSQL,
MariaDB), with table names of its own, dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_idem.contrib.receipts import receipts_table
from tests.conftest import MYSQL_URL, PG_URL, require


@dataclass
class BusinessDB:
    """One business database: an engine, an orders table and a receipts table name."""

    engine: sa.Engine
    orders: sa.Table
    receipts: str

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def order_rows(self) -> list[sa.Row[tuple[object, ...]]]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(self.orders).order_by(self.orders.c.id)))

    def receipt_rows(self) -> list[sa.RowMapping]:
        t = receipts_table(self.receipts)
        with self.engine.connect() as conn:
            if not sa.inspect(conn).has_table(t.name):
                return []
            return list(conn.execute(sa.select(t)).mappings())


def orders_table(name: str) -> sa.Table:
    """Orders with NO unique constraint on the action: a duplicate write would show as a row."""
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("action", sa.String(100), nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
        sa.Column("task_id", sa.String(100), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
    )


def make_db(url: str) -> BusinessDB:
    tag = uuid.uuid4().hex[:10]
    engine = sa.create_engine(url, pool_pre_ping=True)
    orders = orders_table(f"orders_{tag}")
    orders.metadata.create_all(engine)
    return BusinessDB(engine, orders, f"receipts_{tag}")


def drop_db(db: BusinessDB) -> None:
    with db.engine.begin() as conn:
        db.orders.drop(conn, checkfirst=True)
        receipts_table(db.receipts).drop(conn, checkfirst=True)
    db.engine.dispose()


def _business_db(kind: str, tmp_path: Path) -> Iterator[BusinessDB]:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'business.db'}"
    elif kind == "postgresql":
        require(PG_URL, 5432, "PostgreSQL")
        url = PG_URL
    else:
        require(MYSQL_URL, 3306, "MariaDB")
        url = MYSQL_URL
    business = make_db(url)
    yield business
    drop_db(business)


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BusinessDB]:
    yield from _business_db(request.param, tmp_path)


@pytest.fixture(params=["postgresql", "mariadb"])
def concurrent_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BusinessDB]:
    """A database with concurrent writers (not SQLite, where a second writer gets 'database is
    locked' until the first commits, so two holders cannot race inside it)."""
    yield from _business_db(request.param, tmp_path)
