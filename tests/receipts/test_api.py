"""The receipts API on real databases (SQLite file, PostgreSQL, MariaDB), in eager mode.

The gate runs on the in-memory store here (eager mode, one process); the receipt itself is
written to the real business database under test. A "crash after the commit" is a
BaseException raised right after the block: the gate keeps the claim (held, no record), so the
next attempt waits out the 1 s lease and takes over, exactly as after a real SIGKILL (the
real-process version is tests/receipts/test_kills.py).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import Session

from celery_idem import IdempotentTask, LeaseLost
from celery_idem.codec import KombuCodec
from celery_idem.contrib.receipts import Receipt, ReceiptTransaction, purge_receipts, receipts_table
from celery_idem.stores.sql import db_now
from celery_idem.task import get_store
from tests.integration.harness import wait_for
from tests.receipts.conftest import BusinessDB

app = Celery("receipts-unit", set_as_current=False)
app.conf.update(task_always_eager=True, idempotency_store="memory://",
                idempotency_key_prefix="receipts-unit:")

CURRENT: dict[str, Any] = {}


class Crash(BaseException):
    """Stands for the process dying right after the commit (before the record)."""


@app.task(base=IdempotentTask, bind=True, idempotency_lease=1, idempotency_wait=15,
          idempotency_fields=("action",))
def place(self: IdempotentTask, action: str, amount: int, mode: str = "session",
          crash: bool = False, fail: bool = False) -> Any:
    db: BusinessDB = CURRENT["db"]
    values = {"action": action, "amount": amount, "task_id": self.request.id,
              "token": self.idempotency_token}
    if mode == "session":
        with Session(db.engine) as session, \
                self.idempotent_transaction(session, table=db.receipts) as tx:
            session.execute(sa.insert(db.orders).values(**values))
            if fail:
                raise ValueError("declined by the block")
            tx.result = {"action": action, "task_id": self.request.id,
                         "token": self.idempotency_token}
    elif mode == "connection":
        with db.engine.connect() as conn, self.idempotent_transaction(conn, table=db.receipts) as tx:
            conn.execute(sa.insert(db.orders).values(**values))
            tx.result = {"action": action, "task_id": self.request.id}
    else:  # "join": the caller owns the transaction
        with Session(db.engine) as session, session.begin(), \
                self.idempotent_transaction(session, commit=False, table=db.receipts) as tx:
            session.execute(sa.insert(db.orders).values(**values))
            tx.result = {"action": action, "task_id": self.request.id}
    if crash:
        raise Crash()
    return tx.result


@pytest.fixture(autouse=True)
def current(request: pytest.FixtureRequest) -> None:
    # One process, one in-memory store for every test: start each test with no records.
    get_store(app)._records.clear()  # type: ignore[attr-defined]
    # The tasks' business database, for the tests that ask for one (not requested here, so a
    # test on ``concurrent_db`` is not multiplied by every ``db`` parameter)
    if "db" in request.fixturenames:
        CURRENT["db"] = request.getfixturevalue("db")


def test_first_run_commits_the_order_and_its_receipt(db: BusinessDB) -> None:
    out = place.delay("a1", 100).get()
    orders = db.order_rows()
    assert [(o.action, o.task_id) for o in orders] == [("a1", out["task_id"])]
    [receipt] = db.receipt_rows()
    assert receipt["key"] == "receipts-unit:" + place.idempotency_key_for(("a1", 100))
    assert receipt["task_id"] == out["task_id"] and receipt["token"] == out["token"]
    rec = get_store(place.app).get(place.idempotency_key_for(("a1", 100)))
    assert rec is not None and rec.token == out["token"]  # the claim the body ran under
    assert receipt["expires"] > receipt["created"]
    assert KombuCodec().decode_result("k", receipt["content_type"], receipt["data"]) == out


@pytest.mark.parametrize("mode", ["session", "connection", "join"])
def test_crash_after_commit_the_takeover_returns_the_receipt_without_writing(
    db: BusinessDB, mode: str
) -> None:
    # Given an attempt that committed its order and receipt, then died before the record
    with pytest.raises(Crash):
        place.delay("a2", 250, mode=mode, crash=True)
    [first] = db.order_rows()
    # When the action is delivered again (the lease runs out, the new attempt takes over)
    out = place.delay("a2", 250, mode=mode).get()
    # Then the block did not run again: one order, and the result is the committed attempt's
    assert db.order_rows() == [first]
    assert out["task_id"] == first.task_id
    # And the takeover recorded that result: a third delivery is a plain duplicate
    assert place.delay("a2", 250, mode=mode).get() == out
    assert len(db.order_rows()) == 1


def test_an_error_in_the_block_rolls_back_the_write_and_the_receipt(db: BusinessDB) -> None:
    with pytest.raises(ValueError, match="declined by the block"):
        place.delay("a3", 1, fail=True).get()
    assert db.order_rows() == [] and db.receipt_rows() == []
    # ValueError held the claim (not release_on): after the lease, the next attempt writes
    out = place.delay("a3", 1).get()
    assert [o.task_id for o in db.order_rows()] == [out["task_id"]]


@app.task(base=IdempotentTask, bind=True, idempotency_lease=1, idempotency_ttl=1,
          name="receipts-unit.short")
def place_short(self: IdempotentTask, action: str) -> Any:
    db: BusinessDB = CURRENT["db"]
    with Session(db.engine) as session, self.idempotent_transaction(session, table=db.receipts) as tx:
        session.execute(sa.insert(db.orders).values(
            action=action, amount=1, task_id=self.request.id, token=self.idempotency_token))
        tx.result = {"task_id": self.request.id}
    return tx.result


def test_an_expired_receipt_lets_the_action_run_again(db: BusinessDB) -> None:
    # Given an action whose record and receipt live 1 s (idempotency_ttl=1)
    first = place_short.delay("a4").get()
    key = place_short.idempotency_key_for(("a4",))
    t = receipts_table(db.receipts)

    def both_expired() -> bool:
        with db.engine.connect() as conn:
            receipt_live = conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.expires > db_now())
            ).scalar_one()
        return place_short._gate.store.get(key) is None and receipt_live == 0

    wait_for(both_expired, timeout=30, what="the record and the receipt to expire")
    # When the action comes again, it runs again, as on a fresh key (the expired receipt is
    # taken over in place: still one receipt row)
    again = place_short.delay("a4").get()
    assert again["task_id"] != first["task_id"]
    assert [o.task_id for o in db.order_rows()] == [first["task_id"], again["task_id"]]
    [receipt] = db.receipt_rows()
    assert receipt["task_id"] == again["task_id"]


def test_purge_deletes_only_expired_receipts(db: BusinessDB) -> None:
    for action in ("p1", "p2", "p3"):
        place.delay(action, 1).get()
    t = receipts_table(db.receipts)
    with db.engine.begin() as conn:
        conn.execute(sa.update(t).where(t.c.key == "receipts-unit:" + place.idempotency_key_for(("p1", 1)))
                     .values(expires=t.c.created - 1))
    assert purge_receipts(db.engine, table=db.receipts) == 1
    assert len(db.receipt_rows()) == 2
    assert purge_receipts(db.engine, table=db.receipts) == 0
    assert purge_receipts(db.engine, table="celery_idem_receipts_never_made") == 0


@app.task(base=IdempotentTask, bind=True, idempotency_lease=1, name="receipts-unit.guarded",
          idempotency_fields=("action",))
def guarded(self: IdempotentTask, action: str, crash: bool = False) -> Any:
    db: BusinessDB = CURRENT["db"]
    try:
        with Session(db.engine) as session, \
                self.idempotent_transaction(session, table=db.receipts) as tx:
            session.execute(sa.insert(db.orders).values(
                action=action, amount=1, task_id=self.request.id, token=self.idempotency_token))
            tx.result = {"task_id": self.request.id}
    except Exception:  # a body that swallows errors must not swallow the receipt signal
        return "swallowed"
    if crash:
        raise Crash()
    return tx.result


def test_a_found_receipt_is_not_swallowed_by_except_exception(db: BusinessDB) -> None:
    with pytest.raises(Crash):
        guarded.delay("g1", crash=True)
    [first] = db.order_rows()
    assert guarded.delay("g1").get() == {"task_id": first.task_id}
    assert len(db.order_rows()) == 1


# -- bad input -------------------------------------------------------------------------------


def test_outside_a_running_body_is_a_clear_error(db: BusinessDB) -> None:
    with Session(db.engine) as session, pytest.raises(RuntimeError, match="inside the running body"):
        place.idempotent_transaction(session)


@app.task(base=IdempotentTask, bind=True, name="receipts-unit.bad", idempotency_lease=1)
def bad(self: IdempotentTask, what: str) -> str:
    db: BusinessDB = CURRENT["db"]
    target = db.engine if what == "engine" else object()
    try:
        self.idempotent_transaction(target)
    except TypeError as exc:
        return str(exc)
    return "accepted"


@app.task(base=IdempotentTask, bind=True, name="receipts-unit.twice", idempotency_lease=1)
def twice(self: IdempotentTask) -> None:
    db: BusinessDB = CURRENT["db"]
    with Session(db.engine) as session:
        with self.idempotent_transaction(session, table=db.receipts) as tx:
            tx.result = 1
        self.idempotent_transaction(session, table=db.receipts)


@app.task(base=IdempotentTask, bind=True, name="receipts-unit.unencodable", idempotency_lease=1)
def unencodable(self: IdempotentTask) -> None:
    db: BusinessDB = CURRENT["db"]
    with Session(db.engine) as session, self.idempotent_transaction(session, table=db.receipts) as tx:
        session.execute(sa.insert(db.orders).values(action="u", amount=1, task_id="u", token=1))
        tx.result = object()


def test_an_engine_or_other_object_is_refused_with_a_hint(db: BusinessDB) -> None:
    engine_error = bad.delay("engine").get()
    assert "got sqlalchemy.engine.base.Engine" in engine_error
    assert "engine.connect()" in engine_error
    assert "got builtins.object" in bad.delay("object").get()


def test_a_second_block_in_one_run_is_refused(db: BusinessDB) -> None:
    with pytest.raises(RuntimeError, match="already used in this run"):
        twice.delay().get()


def test_an_unencodable_result_rolls_back_with_a_clear_error(db: BusinessDB) -> None:
    with pytest.raises(TypeError, match=r"cannot be encoded .* rolled back"):
        unencodable.delay().get()
    assert db.order_rows() == [] and db.receipt_rows() == []


# -- the API without Celery: holders racing on one key ----------------------------------------


def _tx(conn: sa.Connection, db: BusinessDB, key: str, token: int, **kw: Any) -> ReceiptTransaction:
    return ReceiptTransaction(conn, key=key, token=token, task_id=f"t{token}", codec=KombuCodec(),
                              ttl=3600, table=db.receipts, **kw)


def test_a_key_longer_than_the_column_is_refused(db: BusinessDB) -> None:
    with db.engine.connect() as conn, pytest.raises(ValueError, match="1 to 255 characters"):
        _tx(conn, db, "k" * 256, 1)


def test_a_lost_lease_rolls_back_before_the_commit(db: BusinessDB) -> None:
    with db.engine.connect() as conn, \
            pytest.raises(LeaseLost, match="taken over before the commit"), \
            _tx(conn, db, "lost", 1, lease_lost=lambda: True) as tx:
        conn.execute(sa.insert(db.orders).values(action="lost", amount=1, task_id="t1", token=1))
        tx.result = "x"
    assert db.order_rows() == [] and db.receipt_rows() == []


class Found(BaseException):
    def __init__(self, receipt: Receipt) -> None:
        super().__init__(repr(receipt))
        self.receipt = receipt


class Abort(Exception):
    pass


@pytest.mark.parametrize("first_commits", [True, False])
def test_racing_holders_serialise_on_the_receipt(concurrent_db: BusinessDB, first_commits: bool) -> None:
    db = concurrent_db
    key = f"race-{first_commits}"
    finished = threading.Event()
    outcome: dict[str, Any] = {}

    def second() -> None:
        try:
            with db.engine.connect() as conn:
                tx = _tx(conn, db, key, 2, on_found=Found)
                try:
                    with tx:
                        conn.execute(sa.insert(db.orders).values(action=key, amount=2,
                                                                 task_id="t2", token=2))
                        tx.result = "second"
                    outcome["wrote"] = True
                except Found as found:
                    outcome["found"] = found.receipt
        finally:
            finished.set()

    # Given a first holder inside its block (receipt inserted, order written, not committed)
    thread = threading.Thread(target=second)
    with db.engine.connect() as conn:
        try:
            with _tx(conn, db, key, 1) as tx:
                conn.execute(sa.insert(db.orders).values(action=key, amount=1, task_id="t1",
                                                         token=1))
                tx.result = "first"
                # When a second holder of the same key enters, it blocks on the receipt's key
                thread.start()
                assert not finished.wait(1.5), outcome
                if not first_commits:
                    raise Abort()
        except Abort:
            pass
    thread.join(60)
    assert finished.is_set()
    rows = [(o.action, o.task_id) for o in db.order_rows()]
    if first_commits:
        # Then, once the first commits, the second finds the receipt and writes nothing
        assert isinstance(outcome.get("found"), Receipt), outcome
        assert outcome["found"].value == "first" and outcome["found"].task_id == "t1"
        assert rows == [(key, "t1")]
    else:
        # Then, once the first rolls back, the second holds the receipt and writes
        assert outcome == {"wrote": True}
        assert rows == [(key, "t2")]
