"""``idem forget`` and the other first-hour repairs: expiry in ``show``, token mismatch wording,
the SQL driver hint, and ``stats --events``. Real Redis and PostgreSQL, the command as a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from datetime import datetime, timezone

import pytest

from celery_idem import LeaseLost, TerminalError
from celery_idem.contrib.cli import EXIT_CHANGED, EXIT_NOT_FOUND, EXIT_REFUSED
from celery_idem.records import ClaimStatus, State
from tests.cli.conftest import LONG, Idem

# Every command runs as a `celery` subprocess (about 2 s of imports each): the slow group.
pytestmark = pytest.mark.slow


def test_forget_turns_a_done_record_into_a_tombstone_so_the_next_claim_runs_with_the_next_token(
    idem: Idem,
) -> None:
    # Given a done record
    token = idem.done("op:refunded", {"charged": 4200}, task_id="t-first")
    # When an operator forgets it (after a refund), saying yes at the prompt
    out = idem.run("forget", "op:refunded", input="y\n")
    # Then it asked, showing the outcome it forgets, and forgot it
    assert out.returncode == 0, out.stderr
    assert f"Done record of op:refunded: token {token}, task t-first" in out.stderr
    assert "run the body again" in out.stderr and "Forget it?" in out.stderr
    assert f"forgot the done outcome of op:refunded (token {token}" in out.stdout
    # And it is logged on the celery_idem logger
    assert f"celery_idem forgotten key=op:refunded token={token} original_task_id=t-first" in out.stderr
    # And the next attempt claims it (runs the body) with the next token: fencing kept
    again = idem.store.claim("op:refunded", owner="b", task_id="t-2", attempt=0, lease=LONG, ttl=LONG)
    assert again.status is ClaimStatus.CLAIMED and again.token > token


def test_forget_takes_a_failed_record_and_refuses_a_claim_an_unknown_key_and_no_confirmation(
    idem: Idem,
) -> None:
    token = idem.failed("op:declined", TerminalError("card declined"))
    out = idem.run("forget", "op:declined", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["forgotten"] is True and doc["state"] == "failed" and doc["token"] == token
    assert idem.store.get("op:declined").state is State.RELEASED  # type: ignore[union-attr]
    # A claim in progress is not an outcome
    idem.claim("op:running")
    out = idem.run("forget", "op:running", "--yes")
    assert out.returncode == EXIT_REFUSED and "use `release`" not in out.stdout
    assert "only an outcome can be forgotten" in out.stderr
    # Unknown key
    assert idem.run("forget", "op:nothing", "--yes").returncode == EXIT_NOT_FOUND
    # No confirmation (EOF at the prompt): nothing forgotten
    idem.done("op:kept", 1)
    out = idem.run("forget", "op:kept", input="")
    assert out.returncode == EXIT_REFUSED and "nothing was forgotten" in out.stderr
    assert idem.store.get("op:kept").state is State.DONE  # type: ignore[union-attr]


def test_forget_is_fenced_by_the_token_and_says_token_mismatch(idem: Idem) -> None:
    token = idem.done("op:fenced", 1)
    out = idem.run("forget", "op:fenced", "--token", "7", "--yes", "--json")
    assert out.returncode == EXIT_CHANGED
    err = json.loads(out.stderr)
    assert err["error"] == "token_mismatch"
    assert err["message"].startswith(f"token mismatch: 'op:fenced' has token {token}, and --token was 7")
    assert idem.store.get("op:fenced").state is State.DONE  # type: ignore[union-attr]
    # The store verb itself is fenced too (what the command relies on between read and write)
    with pytest.raises(LeaseLost):
        idem.store.forget("op:fenced", 2)
    idem.claim("op:claimed")
    with pytest.raises(LeaseLost):
        idem.store.forget("op:claimed", 1)  # in progress: release, not forget


def test_show_gives_the_expiry_of_the_record(idem: Idem) -> None:
    idem.done("op:exp", 1)  # TTL LONG (600 s)
    doc = idem.json("show", "op:exp")
    now = time.time()
    assert now + LONG - 30 < doc["expires"] <= now + LONG + 30
    text = idem.run("show", "op:exp").stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("expires"))
    # The whole line, as `idem show` words it: nothing happens at the expiry itself, only an
    # attempt that arrives after it runs the body ("the next attempt runs the body
    # again" reads as if it ran now). The minutes are those left when the command ran.
    shown = re.fullmatch(r"expires +(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ) \(in (?P<min>\d+\.\d) min; "
                         r"an attempt arriving after that runs the body again\)", line)
    assert shown, line
    at = datetime.strptime(shown["at"], "%Y-%m-%d %H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(at.timestamp() - doc["expires"]) <= 2, (line, doc["expires"])
    assert (LONG - 60) / 60 <= float(shown["min"]) <= LONG / 60, line


def test_a_missing_sql_driver_gets_the_pip_hint(idem_redis: Idem) -> None:
    out = idem_redis.run("show", "op:k", env={"IDEM_STORE": "db+postgresql+psycopg2://u@127.0.0.1/x"})
    # psycopg2 is not in the dev set (psycopg 3 is): the driver import fails
    assert out.returncode == EXIT_REFUSED, out.stderr
    assert "pip install 'psycopg2-binary'" in out.stderr and "Traceback" not in out.stderr


def _reset(app: object) -> None:
    """Drop the app's cached store and gates, so a changed prefix takes effect."""
    from celery_idem.app import forget_store

    store = forget_store(app)
    if store is not None:
        store.close()  # not left to the garbage collector (ResourceWarning, docs/contributing.md)
    for task in app.tasks.values():  # type: ignore[attr-defined]
        task.__dict__.pop("_gate", None)


def test_stats_with_events_counts_the_decisions_made_at_enqueue(idem_redis: Idem) -> None:
    import redis

    from tests.integration import app as tasks
    from tests.integration.harness import wait_for

    idem = idem_redis
    key = tasks.charge.idempotency_key_for(("ord_stats", 100))
    idem.done(key, {"charged": 100}, task_id="t-orig")
    broker = redis.Redis.from_url(idem.env["IDEM_BROKER"])
    bindings = "_kombu.binding.celeryev"
    before = set(broker.smembers(bindings))
    listener: list[subprocess.CompletedProcess[str]] = []
    thread = threading.Thread(target=lambda: listener.append(
        idem.run("stats", "--events", "5", "--json", timeout=60)))
    thread.start()
    conf = tasks.app.conf
    saved = conf.idempotency_key_prefix, conf.get("idempotency_events")
    try:
        # The listener's event queue is bound before the producer sends anything
        wait_for(lambda: set(broker.smembers(bindings)) - before, timeout=30,
                 what="the stats listener's event queue")
        # Given a producer that sends events, when it enqueues a done key again and again
        # while the listener runs. The binding is stored before the listener subscribes to
        # the fanout (kombu's Redis transport), so events sent in between reach nobody: the
        # enqueues go on until the listener's window closes, and at least two must be counted.
        conf.idempotency_key_prefix, conf.idempotency_events = idem.prefix, True
        _reset(tasks.app)
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            r = tasks.charge.delay("ord_stats", 100)
            assert r.get(timeout=5) == {"charged": 100}
            thread.join(0.2)  # paces the enqueues; returns at once when the listener is done
    finally:
        conf.idempotency_key_prefix, conf.idempotency_events = saved
        _reset(tasks.app)
        thread.join(60)
        broker.close()
    # Then stats counted both answers, by task and outcome
    out = listener[0]
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    answered = [d["count"] for d in doc["decisions"]
                if d["task"] == "tests.integration.app.charge" and d["outcome"] == "answered"]
    # At least ours: the broker's db 0 may carry other test runs' events for the same task
    assert answered and answered[0] >= 2, doc
