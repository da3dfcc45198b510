"""Fixtures of the scale suite: many worker processes, many hosts, big tables.

Each test builds its own private ``redis-server`` (broker and result backend), its own store
table or key prefix and its own PostgreSQL ledger tables (``tests/chaos/support.py``); the shared
servers are only used through unique names.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from tests.chaos.support import libpq_url
from tests.conftest import PG_URL, require


@pytest.fixture(scope="session")
def pg_ledger_url() -> str:
    """libpq URL of the shared PostgreSQL, for ledgers and catalog queries."""
    require(PG_URL, 5432, "PostgreSQL")
    return libpq_url(PG_URL)


@pytest.fixture
def action() -> Callable[[str], str]:
    """Unique action names for this test: ``action("a")`` -> ``"1a2b3c4d-a"``."""
    run = uuid.uuid4().hex[:8]
    return lambda name: f"{run}-{name}"
