"""``celery -A app idem ...`` driven as a subprocess against a real Redis and a real PostgreSQL."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

from celery_idem import TerminalError
from celery_idem.contrib.cli import EXIT_CHANGED, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_UNAVAILABLE
from celery_idem.records import ClaimStatus, State
from tests.cli.conftest import Idem
from tests.integration import app as tasks
from tests.integration.conftest import Cluster
from tests.integration.harness import ROOT, free_port, wait_for

# Every command runs as a `celery` subprocess (about 2 s of imports each): the slow group.
pytestmark = pytest.mark.slow

CHARGE = "tests.integration.app.charge"


# -- show ------------------------------------------------------------------------------------


def test_show_prints_an_in_progress_claim_with_its_token_owner_lease_and_task_id(idem: Idem) -> None:
    # Given a live claim
    token = idem.claim("op:k1", task_id="t-111", owner="host-a:42")
    # When an operator shows it
    out = idem.run("show", "op:k1")
    # Then every part of the record is on screen
    assert out.returncode == 0, out.stderr
    lines = {line[:13].strip(): line[13:] for line in out.stdout.splitlines()}
    assert lines["key"] == "op:k1"
    assert lines["state"] == "in_progress"
    assert lines["token"] == str(token)
    assert lines["owner"] == "host-a:42"
    assert lines["task id"] == "t-111"
    assert lines["lease"].startswith("lease ") and " left (until " in lines["lease"]  # no task: no verdict
    # And --json has the same, for scripts
    doc = idem.json("show", "op:k1")
    assert doc["state"] == "in_progress" and doc["token"] == token and doc["task_id"] == "t-111"
    assert doc["owner"] == "host-a:42" and doc["lease_expired"] is False
    assert 500 < doc["lease_remaining"] <= 600


def test_show_summarises_the_recorded_result_and_error(idem: Idem) -> None:
    idem.done("op:done", {"order_id": "ord_1", "charged": 4200}, task_id="t-done")
    idem.failed("op:failed", TerminalError("card declined for ord_2"))

    done = idem.run("show", "op:done")
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout and "t-done" in done.stdout
    # The result only with --decode (it runs the app's serializer: tests/cli/test_trust.py)
    assert "not decoded: 38 bytes of application/json" in done.stdout
    assert "ord_1" not in done.stdout and "result" not in idem.json("show", "op:done")
    decoded = idem.run("show", "op:done", "--decode")
    assert "{'order_id': 'ord_1', 'charged': 4200}" in decoded.stdout
    assert idem.json("show", "op:done", "--decode")["result"] == {"order_id": "ord_1", "charged": 4200}

    failed = idem.run("show", "op:failed")
    assert failed.returncode == 0, failed.stderr
    assert "TerminalError: card declined for ord_2" in failed.stdout
    err = idem.json("show", "op:failed")["error"]
    assert err == {"type": "celery_idem.exceptions.TerminalError", "message": "card declined for ord_2"}


def test_show_of_an_unknown_key_exits_1(idem: Idem) -> None:
    out = idem.run("show", "op:nothing")
    assert out.returncode == EXIT_NOT_FOUND
    assert out.stdout == "" and "no record for 'op:nothing'" in out.stderr
    as_json = idem.run("show", "op:nothing", "--json")
    assert as_json.returncode == EXIT_NOT_FOUND and as_json.stdout == ""
    assert json.loads(as_json.stderr)["error"] == "not_found"


# -- list and stats --------------------------------------------------------------------------


def _fill(idem: Idem) -> None:
    """3 done, 2 in progress (one of them with an expired lease), 1 failed, 1 released."""
    for i in range(3):
        idem.done(f"{CHARGE}:done{i}", i)
    idem.claim(f"{CHARGE}:busy")
    idem.claim("other.task:stale", lease=0.05)
    idem.failed("other.task:failed", TerminalError("no"))
    token = idem.claim("other.task:released")
    idem.store.release("other.task:released", token)
    wait_for(lambda: idem.store.get("other.task:stale").lease_expires <= idem.store.now(),  # type: ignore[union-attr]
             timeout=10, what="the stale lease to run out")


def test_list_filters_by_state_and_by_task_and_stops_at_the_limit(idem: Idem) -> None:
    _fill(idem)

    everything = idem.json("list")
    assert everything["count"] == 7 and everything["more"] is False
    busy = idem.json("list", "--state", "in_progress")
    assert sorted(r["key"] for r in busy["records"]) == ["other.task:stale", f"{CHARGE}:busy"]
    stale = next(r for r in busy["records"] if r["key"] == "other.task:stale")
    assert stale["lease_expired"] is True
    # --task filters by the task's operation: the key prefix "<operation>:"
    charge = idem.json("list", "--task", CHARGE)
    assert sorted(r["key"] for r in charge["records"]) == [f"{CHARGE}:busy"] + [
        f"{CHARGE}:done{i}" for i in range(3)]
    assert idem.json("list", "--task", CHARGE, "--state", "done")["count"] == 3
    assert idem.json("list", "--task", "other.task", "--state", "failed")["records"][0]["key"] \
        == "other.task:failed"
    page = idem.json("list", "--limit", "2")
    assert page["count"] == 2 and page["more"] is True

    text = idem.run("list", "--state", "in_progress")
    assert text.returncode == 0, text.stderr
    header, *rows, footer = text.stdout.splitlines()
    assert header.split() == ["STATE", "TOKEN", "LEASE", "UPDATED", "TASK", "ID", "KEY"]
    assert len(rows) == 2 and footer == "2 records"
    assert any("expired" in row and row.endswith("other.task:stale") for row in rows)
    limited = idem.run("list", "--limit", "1")
    assert limited.stdout.splitlines()[-1].startswith("1 records shown; more match")


def test_list_of_an_empty_prefix_says_so_and_exits_0(idem: Idem) -> None:
    out = idem.run("list")
    assert out.returncode == 0 and out.stdout.strip() == "no records"


def test_stats_counts_records_per_state(idem: Idem) -> None:
    _fill(idem)
    doc = idem.json("stats")
    assert {k: doc[k] for k in ("in_progress", "done", "failed", "released", "total")} == {
        "in_progress": 2, "done": 3, "failed": 1, "released": 1, "total": 7}
    assert doc["in_progress_expired"] == 1
    assert idem.json("stats", "--task", CHARGE)["total"] == 4
    text = idem.run("stats")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].split()[:2] == ["in_progress", "2"]
    assert "1 with an expired lease" in text.stdout
    assert text.stdout.splitlines()[-1].split() == ["total", "7"]


def test_list_and_stats_page_through_more_records_than_one_batch(idem: Idem) -> None:
    # Given more records than one scan batch (500)
    for i in range(620):
        idem.claim(f"bulk:{i:04d}")
    # Then stats sees every one, and list stops at its limit
    assert idem.json("stats")["in_progress"] == 620
    assert idem.json("list", "--limit", "600")["count"] == 600


# -- release ---------------------------------------------------------------------------------


def test_release_frees_a_stuck_claim_and_the_next_claim_gets_the_next_token(idem: Idem) -> None:
    # Given a claim whose holder died (its lease ran out)
    stuck = idem.claim("op:stuck", lease=0.05, task_id="t-dead")
    # When an operator releases it
    out = idem.run("release", "op:stuck", "--yes")
    # Then it is released, fenced by the token it showed
    assert out.returncode == 0, out.stderr
    assert f"released op:stuck (token {stuck}, task t-dead)" in out.stdout
    rec = idem.store.get("op:stuck")
    assert rec is not None and rec.state is State.RELEASED
    again = idem.store.claim("op:stuck", owner="h", task_id="t-new", attempt=0, lease=60, ttl=60)
    assert again.status is ClaimStatus.CLAIMED and again.token > stuck


def test_release_asks_first_and_does_nothing_unless_confirmed(idem: Idem) -> None:
    live = idem.claim("op:live", task_id="t-live")
    declined = idem.run("release", "op:live", input="n\n")
    assert declined.returncode == EXIT_REFUSED
    assert "The lease is LIVE" in declined.stderr and "not confirmed" in declined.stderr
    no_stdin = idem.run("release", "op:live", input="")
    assert no_stdin.returncode == EXIT_REFUSED
    assert idem.store.get("op:live").state is State.IN_PROGRESS  # type: ignore[union-attr]

    confirmed = idem.run("release", "op:live", "--json", input="y\n")
    assert confirmed.returncode == 0, confirmed.stderr
    doc = json.loads(confirmed.stdout)
    assert doc == {"released": True, "key": "op:live", "token": live, "task_id": "t-live",
                   "owner": "host-a:1", "lease_was_live": True}
    assert idem.store.get("op:live").state is State.RELEASED  # type: ignore[union-attr]


def test_release_refuses_a_recorded_outcome_and_an_unknown_key(idem: Idem) -> None:
    idem.done("op:done", 1)
    out = idem.run("release", "op:done", "--yes")
    assert out.returncode == EXIT_REFUSED and "is done, not in_progress" in out.stderr
    assert idem.store.get("op:done").state is State.DONE  # type: ignore[union-attr]
    missing = idem.run("release", "op:none", "--yes")
    assert missing.returncode == EXIT_NOT_FOUND


def test_release_with_an_expected_token_refuses_a_newer_claim(idem: Idem) -> None:
    first = idem.claim("op:t", lease=0.05)
    taken = wait_for(lambda: (c := idem.store.claim("op:t", owner="b", task_id="t-b", attempt=0,
                                                    lease=600, ttl=600)).status
                     is ClaimStatus.TAKEOVER and c, timeout=10, what="the takeover")
    assert taken.token > first
    out = idem.run("release", "op:t", "--token", str(first), "--yes")
    assert out.returncode == EXIT_CHANGED
    assert f"token mismatch: 'op:t' has token {taken.token}, and --token was {first}" in out.stderr
    assert idem.store.get("op:t").token == taken.token  # type: ignore[union-attr]


def test_release_is_fenced_when_the_claim_changes_while_the_operator_confirms(idem: Idem) -> None:
    # Given an operator looking at the confirmation prompt for token 1
    old = idem.claim("op:race", lease=0.05, task_id="t-old")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.integration.app", "idem", "release", "op:race"],
        cwd=ROOT, env={**os.environ, **idem.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None and proc.stdin is not None
        seen = ""
        deadline = time.monotonic() + 30
        while "Release it?" not in seen:
            assert time.monotonic() < deadline, f"no prompt: {seen!r}"
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if ready:
                chunk = os.read(proc.stderr.fileno(), 4096).decode()
                assert chunk, f"the command ended before asking: {seen!r}"
                seen += chunk
        # When a redelivered attempt takes the key over meanwhile (token 2)
        taken = idem.store.claim("op:race", owner="b", task_id="t-new", attempt=0, lease=600, ttl=600)
        assert taken.status is ClaimStatus.TAKEOVER and taken.token > old
        # And the operator says yes
        _, err = proc.communicate("y\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # Then the fenced release refuses, and the new holder keeps its claim
    assert proc.returncode == EXIT_CHANGED, err
    assert "changed meanwhile" in err
    rec = idem.store.get("op:race")
    assert rec is not None and rec.state is State.IN_PROGRESS and rec.token == taken.token
    assert rec.task_id == "t-new"


# -- store trouble ---------------------------------------------------------------------------


def test_an_unreachable_store_exits_4(idem: Idem, store_url: str) -> None:
    port = free_port()
    dead = (f"redis://127.0.0.1:{port}/0" if store_url.startswith("redis")
            else f"db+postgresql+psycopg://root@127.0.0.1:{port}/test")
    for args in (("show", "op:k"), ("list",), ("stats",), ("release", "op:k", "--yes")):
        out = idem.run(*args, env={"IDEM_STORE": dead})
        assert out.returncode == EXIT_UNAVAILABLE, (args, out.stderr)
        assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_a_backend_without_a_store_exits_2_naming_the_schemes(idem_redis: Idem) -> None:
    out = idem_redis.run("show", "op:k", env={"IDEM_STORE": "rpc://"})
    assert out.returncode == EXIT_REFUSED
    assert "misconfigured" in out.stderr and "redis://" in out.stderr


# -- key -------------------------------------------------------------------------------------


def test_key_prints_the_key_a_call_would_get(idem_redis: Idem) -> None:
    idem = idem_redis  # the key does not depend on the store
    expected = tasks.charge.idempotency_key_for(("ord_1", 4200), {"note": "x"})
    out = idem.run("key", CHARGE, '"ord_1"', "4200", "--kwargs", '{"note":"x"}')
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    # The note is not one of charge's idempotency_fields: it does not change the key
    assert idem.run("key", CHARGE, '"ord_1"', "4200").stdout.strip() == expected
    assert idem.json("key", CHARGE, '"ord_1"', "--kwargs", '{"amount_cents": 4200}')["key"] == expected
    # Negative numbers are values, not options
    negative = idem.run("key", CHARGE, '"ord_1"', "-5")
    assert negative.stdout.strip() == tasks.charge.idempotency_key_for(("ord_1", -5))
    # A per-call key and a scope, as apply_async takes them
    scoped = idem.run("key", CHARGE, '"ord_1"', "4200", "--key", "agent-1", "--scope", "t-1")
    assert scoped.stdout.strip() == f"{CHARGE}@t-1:key=agent-1"
    bad = idem.run("key", CHARGE, '"ord_1"', "4200", "--scope", "t 1")
    assert bad.returncode == EXIT_REFUSED and "idempotency_scope" in bad.stderr


def test_key_is_one_for_every_spelling_of_a_number(idem_redis: Idem) -> None:
    # JSON has one number type: 4200, 4200.0 and 4.2e3 are one action, as the worker keys them
    keys = {idem_redis.run("key", CHARGE, '"ord_x"', n).stdout.strip()
            for n in ("4200", "4200.0", "4.2e3")}
    assert keys == {tasks.charge.idempotency_key_for(("ord_x", 4200))}
    # A string is not a number, and NaN (which Python's JSON reads) has no key
    assert idem_redis.run("key", CHARGE, '"ord_x"', '"4200"').stdout.strip() not in keys
    nan = idem_redis.run("key", CHARGE, '"ord_x"', "NaN")
    assert nan.returncode == EXIT_REFUSED and "JSON has no NaN or infinity" in nan.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("no.such.task", "1"), EXIT_REFUSED, "no task named 'no.such.task'"),
        (("tests.integration.app.plain", '"x"'), EXIT_REFUSED, "is not an IdempotentTask"),
        ((CHARGE, "ord_1"), EXIT_REFUSED, "is not a JSON value"),
        ((CHARGE, '"a"', "1", '""', "0", "5"), EXIT_REFUSED, "too many positional arguments"),
        ((CHARGE, '"a"', "--kwargs", "[1]"), EXIT_REFUSED, "must be a JSON object"),
    ],
)
def test_key_refuses_what_it_cannot_compute(
    idem_redis: Idem, args: tuple[str, ...], code: int, message: str
) -> None:
    out = idem_redis.run("key", *args)
    assert out.returncode == code and message in out.stderr, out.stderr
    assert out.stdout == ""


# -- records written by a real worker --------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize("store_kind", ["redis", "postgresql"])
def test_show_list_and_stats_see_what_a_real_worker_recorded(
    make_cluster, store_kind: str, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    overrides = {} if store_kind == "redis" else {"IDEM_STORE": "db+" + request.getfixturevalue("pg_url")}
    cluster: Cluster = make_cluster(**overrides)
    cluster.worker(concurrency=1)
    result = tasks.charge.delay("cli_w1", 990)
    assert result.get(timeout=30)["charged"] == 990
    key = tasks.charge.idempotency_key_for(("cli_w1", 990))
    idem = Idem({**cluster.env}, cluster.store)

    # The key command computes the same key the worker used
    assert idem.run("key", CHARGE, '"cli_w1"', "990").stdout.strip() == key
    shown = idem.json("show", key, "--decode")
    assert shown["state"] == "done" and shown["task_id"] == result.id
    assert shown["token"] == result.get(timeout=30)["token"]
    assert shown["result"]["order_id"] == "cli_w1" and shown["result"]["key"] == key
    listed = idem.json("list", "--task", CHARGE, "--state", "done")
    assert [r["key"] for r in listed["records"]] == [key]
    assert idem.json("stats")["done"] == 1
    # A done record is an outcome: it cannot be released
    assert idem.run("release", key, "--yes").returncode == EXIT_REFUSED
    if store_kind == "postgresql":
        _delete_sql_rows(cluster)


def _delete_sql_rows(cluster: Cluster) -> None:
    import sqlalchemy as sa

    store = cluster.store
    table = store._table
    with store._engine.begin() as conn:
        conn.execute(sa.delete(table).where(table.c.key.startswith(cluster.prefix, autoescape=True)))
