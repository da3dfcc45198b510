"""What an operator's tools do with records they cannot trust.

* Stored strings print escaped: a record planted straight in the store (no key check on the
  way) with ANSI escapes, newlines or a bidi override in its key, owner, task id or error
  reaches neither the terminal nor the log as itself.
* ``show`` never decodes a stored result unless asked with ``--decode``: a planted pickle whose
  unpickling creates a file does not run (it does with ``--decode``, after a warning).
* ``release``, ``forget`` and ``purge`` log the OS user, the host and ``--reason`` at WARNING,
  and send an ``idem-operator`` event, seen here by a real ``EventReceiver`` on the real broker.

The commands run as ``celery`` subprocesses on real Redis and PostgreSQL stores.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import pathlib
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from celery_idem import TerminalError
from celery_idem.codec import encode_error
from celery_idem.records import State
from tests.cli.conftest import LONG, Idem, _idem
from tests.cli.test_purge import _expired_records
from tests.integration.harness import fanout_subscribed, free_port, wait_for

# Every command runs as a `celery` subprocess (about 2 s of imports each): the slow group.
pytestmark = pytest.mark.slow

CLI_APP = "tests.cli.cli_app"
ESC_KEY = "op:key=\x1b[31mred\x1b[0m\u202eevil\ncelery_idem recorded key=forged"
PICKLE = "application/x-python-serialize"


def _unsafe(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (line breaks between lines aside)."""
    return [c for c in text.replace("\n", "") if not c.isprintable()]


def _assert_clean(out: Any) -> None:
    for name in ("stdout", "stderr"):
        text = getattr(out, name)
        assert _unsafe(text) == [], (name, text)
        # The key's newline did not start a line of its own (a forged log line)
        assert not any(line.startswith("celery_idem recorded key=forged")
                       for line in text.splitlines()), (name, text)


def _plant(idem: Idem, key: str, *, state: State, owner: str = "h:1", task_id: str = "t-1",
           content_type: str = "application/json", data: bytes = b"1") -> int:
    """A record written through the store's verbs only: no key check, as an intruder would."""
    got = idem.store.claim(key, owner=owner, task_id=task_id, attempt=0, lease=LONG, ttl=LONG)
    assert got.status.holds, got
    if state is not State.IN_PROGRESS:
        idem.store.record(key, got.token, state=state, content_type=content_type, data=data, ttl=LONG)
    return got.token


# -- 8: what the commands print is escaped -----------------------------------------------------


def test_control_characters_in_stored_strings_print_escaped_in_every_verb(idem: Idem) -> None:
    # Given records planted with control and bidi characters in key, owner, task id and error
    owner = "host\x1b]0;pwned\x07:1"
    task_id = "t\r\n-\u2028id"
    _plant(idem, ESC_KEY, state=State.IN_PROGRESS, owner=owner, task_id=task_id)
    failed_key = "op:key=failed\x1b[2J"
    ctype, data = encode_error(TerminalError("declined\n\x1b[31mcelery_idem recorded key=forged"))
    _plant(idem, failed_key, state=State.FAILED, content_type=ctype, data=data)
    del_key = "op:key=del\x7fete"
    _plant(idem, del_key, state=State.DONE)

    # Each verb is a `celery` process whose start (imports) is most of its time: the read-only
    # views run all at once, then the verbs that change records
    views = {
        "show": ("show", ESC_KEY), "failed": ("show", failed_key), "list": ("list",),
        "missing": ("show", "op:key=\x1b[5mnone"),
        "show-json": ("show", ESC_KEY, "--json"), "list-json": ("list", "--json"),
        "del-json": ("show", del_key, "--json"), "failed-json": ("show", failed_key, "--json"),
        "missing-json": ("show", "op:key=\x1b[5mnone", "--json"),
    }
    out = _run_all(idem, views)

    # show: every stored string escaped, as a shell's $'...' that pastes back to the key
    show = out["show"]
    assert show.returncode == 0, show.stderr
    _assert_clean(show)
    lines = {line[:13].strip(): line[13:] for line in show.stdout.splitlines()}
    assert lines["key"] == ("$'op:key=\\x1b[31mred\\x1b[0m\\u202eevil\\ncelery_idem recorded "
                            "key=forged'")
    assert lines["owner"] == "$'host\\x1b]0;pwned\\x07:1'"
    assert lines["task id"] == "$'t\\r\\n-\\u2028id'"
    failed = out["failed"]
    _assert_clean(failed)
    assert "declined\\n\\x1b[31mcelery_idem recorded key=forged" in failed.stdout
    # list: the key and task id columns
    listed = out["list"]
    assert listed.returncode == 0, listed.stderr
    _assert_clean(listed)
    assert "$'op:key=failed\\x1b[2J'" in listed.stdout and "$'op:key=del\\x7fete'" in listed.stdout
    # JSON: escaped by json.dumps (DEL included), and the values are the stored strings
    for name in ("show-json", "list-json", "del-json", "failed-json"):
        assert out[name].returncode == 0, out[name].stderr
        assert _unsafe(out[name].stdout) == [] and out[name].stdout.isascii(), out[name].stdout
    doc = json.loads(out["show-json"].stdout)
    assert doc["key"] == ESC_KEY and doc["owner"] == owner and doc["task_id"] == task_id
    assert json.loads(out["del-json"].stdout)["key"] == del_key
    assert json.loads(out["failed-json"].stdout)["error"]["message"].startswith("declined\n\x1b[31m")
    not_found = out["missing-json"]
    assert _unsafe(not_found.stderr) == [] and json.loads(not_found.stderr)["error"] == "not_found"
    # not found: the message quotes the key escaped
    missing = out["missing"]
    assert missing.returncode == 1
    _assert_clean(missing)

    # release declined: the prompt (stderr); forget: the prompt shows the escaped error (another
    # key, so the two run at once)
    out = _run_all(idem, {"declined": ("release", ESC_KEY), "forgot": ("forget", failed_key)},
                   inputs={"declined": "n\n", "forgot": "y\n"})
    declined = out["declined"]
    assert declined.returncode == 2
    _assert_clean(declined)
    assert "Claim of $'op:key=\\x1b[31mred" in declined.stderr
    forgot = out["forgot"]
    assert forgot.returncode == 0, forgot.stderr
    _assert_clean(forgot)
    assert "error TerminalError: declined\\n\\x1b[31m" in forgot.stderr
    # release: the answer (stdout) and the log line (stderr)
    released = idem.run("release", ESC_KEY, "--yes", "--reason", "ticket\n\x1b[1mOPS-1")
    assert released.returncode == 0, released.stderr
    _assert_clean(released)
    assert "released $'op:key=\\x1b[31mred" in released.stdout
    assert "reason=ticket\\n\\x1b[1mOPS-1" in released.stderr


def _run_all(idem: Idem, commands: dict[str, tuple[str, ...]],
             inputs: dict[str, str] | None = None) -> dict[str, Any]:
    """Run each of ``commands`` (name: arguments) as its own process, all at once."""
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(idem.run, *args, input=(inputs or {}).get(name))
                   for name, args in commands.items()}
        return {name: future.result() for name, future in futures.items()}


# -- 9: no decoding unless asked -----------------------------------------------------------------


class _Touch:
    """Unpickling it creates ``path``: what a planted pickle could do instead."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def test_show_decodes_a_pickled_result_only_with_decode_and_warns(idem_redis: Idem,
                                                                    tmp_path: pathlib.Path) -> None:
    idem = idem_redis
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Touch(marker))
    assert not marker.exists()
    # Given a record planted in Redis with a pickle payload, and an app that accepts pickle
    _plant(idem, "op:key=planted", state=State.DONE, content_type=PICKLE, data=payload)
    pickle_env = {"IDEM_ACCEPT": "json,pickle"}

    # When an operator looks at it (text, JSON, and the forget prompt): nothing is unpickled
    shown = idem.run("show", "op:key=planted", app=CLI_APP, env=pickle_env)
    assert shown.returncode == 0, shown.stderr
    assert f"not decoded: {len(payload)} bytes of {PICKLE} (--decode decodes it)" in shown.stdout
    as_json = idem.run("show", "op:key=planted", "--json", app=CLI_APP, env=pickle_env)
    doc = json.loads(as_json.stdout)
    assert doc["decoded"] is False and "result" not in doc
    assert doc["content_type"] == PICKLE and doc["result_bytes"] == len(payload)
    declined = idem.run("forget", "op:key=planted", app=CLI_APP, env=pickle_env, input="n\n")
    assert declined.returncode == 2 and "not decoded" in declined.stderr
    assert not marker.exists()

    # With --decode, but an app that does not accept pickle: refused, still not unpickled
    refused = idem.run("show", "op:key=planted", "--decode", "--json")
    assert refused.returncode == 0, refused.stderr
    assert "--decode runs the result serializer" in refused.stderr
    assert json.loads(refused.stdout)["result_error"]
    assert not marker.exists()

    # With --decode and pickle accepted: it warns, then the payload runs (what it protects from)
    decoded = idem.run("show", "op:key=planted", "--decode", app=CLI_APP, env=pickle_env)
    assert decoded.returncode == 0, decoded.stderr
    assert "Warning: --decode runs the result serializer on the bytes stored under " \
           "'op:key=planted'" in decoded.stderr and "pickle" in decoded.stderr
    assert marker.exists()


def test_show_decode_of_a_json_result_prints_it(idem_redis: Idem) -> None:
    idem = idem_redis
    idem.done("op:k", {"order_id": "ord_1"})
    plain = idem.run("show", "op:k")
    assert "{'order_id'" not in plain.stdout and "bytes of application/json" in plain.stdout
    decoded = idem.run("show", "op:k", "--decode")
    assert "{'order_id': 'ord_1'}" in decoded.stdout and "Warning: --decode" in decoded.stderr
    assert idem.json("show", "op:k", "--decode")["result"] == {"order_id": "ord_1"}


# -- 10: who changed what, and why -------------------------------------------------------------


def _audit_line(stderr: str, verb: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(f"celery_idem {verb} ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_release_and_forget_log_the_user_host_and_reason(idem: Idem) -> None:
    user, host = getpass.getuser(), socket.gethostname()
    token = idem.claim("op:stuck", lease=0.05, task_id="t-dead")
    out = idem.run("release", "op:stuck", "--yes", "--reason", "worker node lost, INC-1234")
    assert out.returncode == 0, out.stderr
    assert _audit_line(out.stderr, "released") == (
        f"celery_idem released key=op:stuck token={token} task_id=t-dead owner=host-a:1 by=cli "
        f"user={user} host={host} reason=worker node lost, INC-1234")
    token = idem.done("op:refunded", 1, task_id="t-first")
    out = idem.run("forget", "op:refunded", "--yes")
    assert out.returncode == 0, out.stderr
    assert _audit_line(out.stderr, "forgotten").endswith(f"by=cli user={user} host={host} reason=-")


@contextlib.contextmanager
def _operator_events(broker_url: str) -> Iterator[list[dict[str, Any]]]:
    """Collect ``idem-operator`` events from the broker while the block runs (bounded)."""
    import redis

    from tests.integration import app as tasks

    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    client = redis.Redis.from_url(broker_url)
    consuming: list[Any] = []  # the receiver's channel, once it consumes

    def listen() -> None:
        deadline = time.monotonic() + 90  # the bound, whatever the test does

        def on_iteration() -> None:
            if stop.is_set() or time.monotonic() > deadline:
                receiver.should_stop = True

        with tasks.app.connection_for_read(broker_url) as conn:
            receiver = tasks.app.events.Receiver(conn, handlers={"idem-operator": seen.append})
            receiver.on_iteration = on_iteration
            original = receiver.on_consume_ready

            def on_consume_ready(conn: Any, channel: Any, *args: Any, **kwargs: Any) -> None:
                original(conn, channel, *args, **kwargs)
                consuming.append(channel)

            receiver.on_consume_ready = on_consume_ready
            with contextlib.suppress(socket.timeout, TimeoutError):
                receiver.capture(limit=None, timeout=95, wakeup=False)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        # The receiver is subscribed before anything is sent: each command sends its event
        # once, and kombu stores the queue's binding before it subscribes to the fanout.
        wait_for(lambda: consuming and fanout_subscribed(consuming[0], client), timeout=30,
                 what="the event receiver's subscription")
        yield seen
    finally:
        stop.set()
        thread.join(30)
        client.close()


def test_release_sends_an_operator_event_when_events_are_on(idem_redis: Idem) -> None:
    idem = idem_redis
    token = idem.claim("op:evt", task_id="t-evt")
    with _operator_events(idem.env["IDEM_BROKER"]) as seen:
        out = idem.run("release", "op:evt", "--yes", "--reason", "INC-77", app=CLI_APP,
                       env={"IDEM_EVENTS": "1"})
        assert out.returncode == 0, out.stderr
        assert "not sent" not in out.stderr
        mine = wait_for(lambda: [e for e in seen if e.get("key") == "op:evt"], timeout=30,
                        what="the idem-operator event")
    event = mine[0]
    assert event["type"] == "idem-operator" and event["verb"] == "released"
    assert event["token"] == token and event["task_id"] == "t-evt" and event["reason"] == "INC-77"
    assert event["by"] == "cli" and event["user"] == getpass.getuser()
    assert event["host"] == socket.gethostname()


def test_forget_sends_an_operator_event_when_events_are_on(idem_redis: Idem) -> None:
    idem = idem_redis
    key, reason = f"op:evt-forget-{uuid.uuid4().hex[:8]}", "refund undone by hand, INC-78"
    token = idem.done(key, {"refund": "re_1"}, task_id="t-refunded")
    with _operator_events(idem.env["IDEM_BROKER"]) as seen:
        out = idem.run("forget", key, "--yes", "--reason", reason, app=CLI_APP,
                       env={"IDEM_EVENTS": "1"})
        assert out.returncode == 0, out.stderr
        assert "not sent" not in out.stderr
        mine = wait_for(lambda: [e for e in seen if e.get("key") == key], timeout=30,
                        what="the idem-operator event")
    assert len(mine) == 1, mine
    event = mine[0]
    assert event["type"] == "idem-operator" and event["verb"] == "forgotten"
    assert event["token"] == token and event["original_task_id"] == "t-refunded"
    assert event["state"] == "done" and event["reason"] == reason
    assert event["by"] == "cli" and event["user"] == getpass.getuser()
    assert event["host"] == socket.gethostname()
    assert idem.store.get(key).state is State.RELEASED  # type: ignore[union-attr]


@pytest.fixture
def idem_sql(pg_url: str, redis_url: str) -> Iterator[Idem]:
    """The command on a fresh prefix of the SQL store (only SQL stores have rows to purge)."""
    yield from _idem("db+" + pg_url, redis_url)


def test_purge_sends_an_operator_event_when_events_are_on(idem_sql: Idem) -> None:
    idem = idem_sql
    _expired_records(idem, [f"op:evt-old{i}" for i in range(3)])
    # The event names no key: the reason (unique) tells this purge from any other
    reason = f"nightly cleanup, INC-{uuid.uuid4().hex[:8]}"
    with _operator_events(idem.env["IDEM_BROKER"]) as seen:
        out = idem.run("purge", "--reason", reason, app=CLI_APP, env={"IDEM_EVENTS": "1"})
        assert out.returncode == 0, out.stderr
        assert "not sent" not in out.stderr
        mine = wait_for(lambda: [e for e in seen if e.get("reason") == reason], timeout=30,
                        what="the idem-operator event")
    assert len(mine) == 1, mine
    event = mine[0]
    assert event["type"] == "idem-operator" and event["verb"] == "purged"
    assert event["deleted"] == 3 and event["batches"] == 1 and event["complete"] is True
    assert event["by"] == "cli" and event["user"] == getpass.getuser()
    assert event["host"] == socket.gethostname()


def test_an_unreachable_broker_does_not_undo_or_hang_the_change(idem_redis: Idem) -> None:
    idem = idem_redis
    idem.claim("op:nobroker")
    started = time.monotonic()
    out = idem.run("release", "op:nobroker", "--yes", app=CLI_APP,
                   env={"IDEM_EVENTS": "1", "IDEM_BROKER": f"redis://127.0.0.1:{free_port()}/0"})
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 45
    assert "the change was made, but its idem-operator event was not sent" in out.stderr
    assert idem.store.get("op:nobroker").state is State.RELEASED  # type: ignore[union-attr]
