"""``celery -A app idem purge``: delete expired records, run as a subprocess on real stores."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from celery_idem.contrib.cli import EXIT_UNAVAILABLE
from celery_idem.records import State
from tests.cli.conftest import Idem, _idem
from tests.integration.harness import free_port, wait_for

# Every command runs as a `celery` subprocess (about 2 s of imports each): the slow group.
pytestmark = pytest.mark.slow

SHORT_TTL = 0.5


@pytest.fixture
def idem_sql(pg_url: str, redis_url: str) -> Iterator[Idem]:
    """The command on a fresh prefix of the SQL store (PostgreSQL): what only SQL stores do."""
    yield from _idem("db+" + pg_url, redis_url)


def _expired_records(idem: Idem, names: list[str]) -> None:
    """Done records with a half-second TTL, waited for (store clock) until they have expired."""
    for name in names:
        got = idem.store.claim(name, owner="h:1", task_id=f"t-{name}", attempt=0, lease=SHORT_TTL,
                               ttl=SHORT_TTL)
        idem.store.record(name, got.token, state=State.DONE, content_type="application/json",
                          data=b"1", ttl=SHORT_TTL)
    wait_for(lambda: all(idem.store.get(n) is None for n in names), timeout=30,
             what="the short-TTL records to expire")


def _rows(idem: Idem) -> int:
    """Rows under the test's prefix, expired or not (the SQL table itself)."""
    import sqlalchemy as sa

    store = idem.store
    t = store._table  # type: ignore[attr-defined]
    with store._engine.connect() as conn:  # type: ignore[attr-defined]
        query = sa.select(sa.func.count()).where(t.c.key.startswith(idem.prefix, autoescape=True))
        return int(conn.execute(query).scalar_one())


def test_purge_deletes_expired_sql_rows_in_batches_and_keeps_live_ones(idem: Idem) -> None:
    if not idem.env["IDEM_STORE"].startswith("db+"):
        # Given Redis: expired records are gone by themselves, so purge has nothing to do
        out = idem.json("purge")
        assert out == {"deleted": 0, "batches": 0, "seconds": 0.0, "complete": True,
                       "supported": False}
        assert "nothing to purge" in idem.run("purge").stdout
        return
    # Given five expired rows (still in the table, counted as absent) and one live record
    _expired_records(idem, [f"op:old{i}" for i in range(5)])
    idem.done("op:live", {"ok": True})
    assert _rows(idem) == 6
    # When purging two rows per statement
    report = idem.json("purge", "--batch", "2")
    # Then three DELETEs removed the five expired rows, and the live record is untouched
    assert report["deleted"] == 5 and report["batches"] == 3 and report["complete"] is True
    assert report["supported"] is True
    assert _rows(idem) == 1
    assert idem.store.get("op:live") is not None
    # And a second purge finds nothing, in text form too
    out = idem.run("purge")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("deleted 0 expired records in 1 batch")


def test_purge_stops_at_max_seconds_and_says_more_remain(idem_sql: Idem) -> None:
    idem = idem_sql
    _expired_records(idem, [f"op:old{i}" for i in range(3)])
    out = idem.run("purge", "--batch", "1", "--max-seconds", "0")
    assert out.returncode == 0, out.stderr
    assert "deleted 1 expired record in 1 batch" in out.stdout and "run it again" in out.stdout
    assert _rows(idem) == 2
    assert idem.json("purge", "--batch", "1")["deleted"] == 2


def test_purge_of_an_unreachable_sql_store_exits_4(idem_sql: Idem) -> None:
    idem = idem_sql
    port = free_port()
    dead = f"db+postgresql+psycopg://root@127.0.0.1:{port}/test"
    out = idem.run("purge", "--json", env={"IDEM_STORE": dead})
    assert out.returncode == EXIT_UNAVAILABLE
    assert json.loads(out.stderr)["error"] == "store_unavailable"


def test_purge_refuses_a_batch_below_one(idem: Idem) -> None:
    out = idem.run("purge", "--batch", "0")
    assert out.returncode == 2 and "--batch" in out.stderr


def test_a_purge_that_deleted_rows_is_logged_with_user_host_and_reason(idem_sql: Idem) -> None:
    import getpass
    import socket

    idem = idem_sql
    # Nothing to delete: no audit line (an expired row is already absent to every reader)
    quiet = idem.run("purge", "--reason", "nightly")
    assert quiet.returncode == 0 and "celery_idem purged" not in quiet.stderr
    _expired_records(idem, ["op:old0", "op:old1"])
    out = idem.run("purge", "--reason", "disk at 90%, OPS-3")
    assert out.returncode == 0, out.stderr
    [line] = [ln for ln in out.stderr.splitlines() if ln.startswith("celery_idem purged ")]
    assert line == (f"celery_idem purged deleted=2 batches=1 complete=True by=cli "
                    f"user={getpass.getuser()} host={socket.gethostname()} reason=disk at 90%, OPS-3")
