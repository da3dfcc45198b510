"""celery_idem.contrib.ops in process: the operator's log record, the OS user fallback, the escapes."""

from __future__ import annotations

import getpass
import logging
import socket

import pytest

from celery_idem.contrib import ops
from celery_idem.records import State
from celery_idem.stores.memory import MemoryStore


def test_a_release_logs_who_where_and_why_on_the_log_record(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    got = store.claim("op:k", owner="h:1", task_id="t-1", attempt=0, lease=60, ttl=60)
    operator = ops.Operator.here("cli", "  INC-9: stuck  ")
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        ops.release_claim(store, "op:k", got.token, by=operator)
    [record] = [r for r in caplog.records if r.name == "celery_idem"]
    assert record.levelno == logging.WARNING
    fields = record.idem_operator  # type: ignore[attr-defined]
    assert fields == {"verb": "released", "key": "op:k", "token": got.token, "task_id": "t-1",
                      "owner": "h:1", "by": "cli", "user": getpass.getuser(),
                      "host": socket.gethostname(), "reason": "INC-9: stuck"}
    assert store.get("op:k").state is State.RELEASED  # type: ignore[union-attr]


def test_the_user_falls_back_to_the_uid_when_getpass_cannot_name_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_name() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", no_name)
    assert ops.Operator.here("cli").user.startswith("uid:")


def test_a_long_reason_is_cut_and_an_empty_one_is_none() -> None:
    assert ops.Operator.here("cli", "x" * 2000).reason == "x" * (ops.REASON_LENGTH - 1) + "…"
    assert ops.Operator.here("cli", "   ").reason is None


@pytest.mark.parametrize(
    ("text", "printable", "shown"),
    [
        ("op:abc", "op:abc", "op:abc"),
        ("a\x1b[31mb", "a\\x1b[31mb", "$'a\\x1b[31mb'"),
        ("a\nb\tc\r", "a\\nb\\tc\\r", "$'a\\nb\\tc\\r'"),
        ("a\u202eb\u2028", "a\\u202eb\\u2028", "$'a\\u202eb\\u2028'"),
        ("\x7f\x85\xa0", "\\x7f\\u0085\\u00a0", "$'\\x7f\\u0085\\u00a0'"),
        ("tag\U000e0041", "tag\\U000e0041", "$'tag\\U000e0041'"),
        ("c:\\p", "c:\\p", "$'c:\\\\p'"),  # a backslash is quoted: shown text is unambiguous
        ("it's", "it's", "it's"),
        ("a'\n", "a'\\n", "$'a\\'\\n'"),
        ("$'x'", "$'x'", "$'$\\'x\\''"),
    ],
)
def test_printable_and_shown(text: str, printable: str, shown: str) -> None:
    assert ops.printable(text) == printable
    assert ops.shown(text) == shown


def test_shown_pastes_back_into_bash_as_the_same_string() -> None:
    import shutil
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    text = "op:key=\x1b[31m\u202e\\'\n\x85\U000e0041 end"
    out = subprocess.run([bash, "-c", f"printf '%s' {ops.shown(text)}"], capture_output=True,
                         timeout=10, check=True)
    assert out.stdout.decode() == text
