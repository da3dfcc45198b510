"""Tools at the edge of trust, through a real ``celery worker``: scopes, reused keys,
failure text, and hostile arguments.

Each test names the weakness it closes; each failed on the code before the issue (a scope was
not accepted, a reused key swallowed the second action, the body's error text reached the
model, deep arguments raised instead of answering).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import pytest

from celery_idem import InvalidKey
from celery_idem.contrib.tools import MAX_ARGUMENT_DEPTH, MAX_ARGUMENTS_SIZE, Toolbox, tool
from tests.tools.app import (
    CardDeclined,
    charge_card,
    charge_declined,
    charge_with_key,
    charge_with_key_late,
    over_quota,
    refund,
    sync_ledger,
)
from tests.tools.conftest import Env
from tests.tools.support import PYDANTIC_AI

pytestmark = pytest.mark.worker

#: A call's wait, generous for a loaded machine; it never delays a passing test.
WAIT = 60.0


def order() -> str:
    return f"ord_{uuid.uuid4().hex[:8]}"


def box(scope: str | None = None) -> Toolbox:
    return Toolbox([
        tool(charge_card, timeout=WAIT),
        tool(charge_with_key, timeout=WAIT, key_argument="request_key"),
        tool(charge_with_key_late, timeout=WAIT, key_argument="request_key"),
        tool(sync_ledger, timeout=WAIT),
        tool(refund, timeout=WAIT),
        tool(charge_declined, timeout=WAIT, expose_errors=(CardDeclined,)),
        tool(charge_declined, name="charge_declined_quiet", timeout=WAIT),
        tool(over_quota, timeout=WAIT),
    ], scope=scope)


# -- scopes -------------------------------------------------------------------------------------


def test_the_same_key_in_two_scopes_is_two_actions(live: Env) -> None:
    oid, key = order(), f"k-{uuid.uuid4().hex[:8]}"
    tools = box()
    arguments = {"order_id": oid, "amount_cents": 100, "request_key": key}
    a = tools.call("charge_with_key", arguments, scope="tenant-a")
    b = tools.call("charge_with_key", arguments, scope="tenant-b")
    assert a["status"] == b["status"] == "ok", (a, b)
    # Each scope's key is its own, and each body saw its own
    assert a["idempotency_key"] == charge_with_key.idempotency_key_for(
        kwargs={"order_id": oid, "amount_cents": 100}, idempotency_key=key,
        idempotency_scope="tenant-a")
    assert "@tenant-a:" in a["idempotency_key"] and "@tenant-b:" in b["idempotency_key"]
    assert [a["result"]["key"], b["result"]["key"]] == [a["idempotency_key"], b["idempotency_key"]]
    # Repeated in its own scope, each is a duplicate of its own action only
    again = tools.call("charge_with_key", arguments, scope="tenant-b")
    assert again["status"] == "duplicate" and again["task_id"] == b["task_id"], again
    assert sorted(live.effects(f"keyed:{oid}")) == sorted([a["idempotency_key"],
                                                            b["idempotency_key"]])


def test_a_derived_key_is_scoped_too_and_the_toolbox_scope_is_the_default(live: Env) -> None:
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 250}
    tenant_a, tenant_b = box(scope="tenant-a"), box(scope="tenant-b")
    first = tenant_a.call("charge_card", arguments)
    other = tenant_b.call("charge_card", arguments)
    assert first["status"] == other["status"] == "ok", (first, other)
    assert first["idempotency_key"] == charge_card.idempotency_key_for(
        kwargs=arguments, idempotency_scope="tenant-a")
    # A call's own scope wins over the toolbox's
    assert tenant_b.call("charge_card", arguments, scope="tenant-a")["status"] == "duplicate"
    # The async twin takes the same scope
    again = asyncio.run(tenant_a.acall("charge_card", arguments))
    assert again["status"] == "duplicate" and again["task_id"] == first["task_id"], again
    assert len(live.effects(f"charge:{oid}")) == 2


def test_the_framework_adapters_call_in_the_toolbox_scope(live: Env) -> None:
    import langchain_core  # noqa: F401  (in the dev extra: a missing one fails, never skips)

    oid = order()
    arguments = {"order_id": oid, "amount_cents": 42}
    tools = Toolbox([tool(charge_card, timeout=WAIT)], scope="tenant-lc")
    out = {t.name: t for t in tools.langchain()}["charge_card"].invoke(arguments)
    assert out["status"] == "ok" and "@tenant-lc:" in out["idempotency_key"], out
    # pydantic-ai's tool awaits ainvoke in the same scope: the same action, a duplicate
    if PYDANTIC_AI:  # Python 3.11+ (tests.tools.support); LangChain's half runs on every version
        function = tools.pydantic_ai()[0].function
        again = asyncio.run(function(**arguments))
        assert again["status"] == "duplicate" and again["task_id"] == out["task_id"], again
    assert len(live.effects(f"charge:{oid}")) == 1


def test_a_bad_scope_is_the_callers_mistake_and_raises(live: Env) -> None:
    with pytest.raises(InvalidKey):
        Toolbox([tool(charge_card)], scope="tenant a")
    tools = box()
    for bad in ("", "t" * 65, "tenant\n1", "tenant:1"):
        with pytest.raises(InvalidKey):
            tools.call("charge_card", {"order_id": "o", "amount_cents": 1}, scope=bad)
    with pytest.raises(InvalidKey):
        asyncio.run(tools.acall("charge_card", {"order_id": "o", "amount_cents": 1}, scope="a b"))


def test_a_key_argument_cannot_read_another_tools_action(live: Env) -> None:
    # Given a charge done, and its key as the outcome shows it
    oid = order()
    tools = box()
    charge = tools.call("charge_card", {"order_id": oid, "amount_cents": 999})
    assert charge["status"] == "ok", charge
    # When a model passes that key (as is, or bare) to another tool
    for stolen in (charge["idempotency_key"], charge["idempotency_key"].split(":", 1)[1]):
        out = tools.call("charge_with_key", {"order_id": oid, "amount_cents": 1,
                                             "request_key": stolen})
        # Then that tool does its own action, and never sees the charge's result
        assert out["status"] == "ok", out
        assert out["result"]["order_id"] == oid and "charge_id" not in out["result"]
        assert out["idempotency_key"].startswith(f"{charge_with_key.name}:key=")
    assert len(live.effects(f"keyed:{oid}")) == 2


# -- a key reused for another action ------------------------------------------------------------


def test_a_key_reused_with_other_arguments_is_a_mismatch_at_enqueue(live: Env) -> None:
    oid, key = order(), f"k-{uuid.uuid4().hex[:8]}"
    tools = box()
    first = tools.call("charge_with_key", {"order_id": oid, "amount_cents": 5000,
                                           "request_key": key})
    assert first["status"] == "ok", first
    out = tools.call("charge_with_key", {"order_id": oid, "amount_cents": 1, "request_key": key})
    assert out["status"] == "error" and out["error"] == "IdempotencyKeyMismatch", out
    assert out["retryable"] is False and out["task_id"] is None  # refused before the publish
    assert "Use a new key for a new action" in out["message"]
    # The same key with the first call's arguments is still the first action
    same = tools.call("charge_with_key", {"order_id": oid, "amount_cents": 5000,
                                          "request_key": key})
    assert same["status"] == "duplicate" and same["result"]["amount_cents"] == 5000, same
    assert len(live.effects(f"keyed:{oid}")) == 1


def test_a_key_reused_with_other_arguments_is_a_mismatch_from_the_worker(live: Env) -> None:
    # charge_with_key_late reads no record at enqueue: the worker's gate refuses the reuse
    oid, key = order(), f"k-{uuid.uuid4().hex[:8]}"
    tools = box()
    first = tools.call("charge_with_key_late", {"order_id": oid, "amount_cents": 5000,
                                                "request_key": key})
    assert first["status"] == "ok", first
    out = tools.call("charge_with_key_late", {"order_id": oid, "amount_cents": 1,
                                              "request_key": key})
    assert out["status"] == "error" and out["error"] == "IdempotencyKeyMismatch", out
    assert out["task_id"] not in (None, first["task_id"])  # sent, and refused by the worker
    assert out["retryable"] is False and "Use a new key for a new action" in out["message"]
    assert len(live.effects(f"keyed:{oid}")) == 1


def test_a_key_argument_with_control_characters_is_invalid_and_nothing_runs(live: Env) -> None:
    oid = order()
    tools = box()
    for bad in ("k\ncelery_idem recorded forged", "k\x1b[31m", "k\u202e"):
        out = tools.call("charge_with_key", {"order_id": oid, "amount_cents": 1,
                                             "request_key": bad})
        assert out["status"] == "error" and out["error"] == "InvalidArguments", out
        assert "request_key" in out["message"] and "Nothing was done" in out["message"]
        assert out["task_id"] is None
    assert live.effects(f"keyed:{oid}") == []


# -- failure text -------------------------------------------------------------------------------


def test_a_bodys_error_text_goes_to_the_log_not_to_the_model(
        live: Env, caplog: pytest.LogCaptureFixture) -> None:
    account = f"acct{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        out = box().call("sync_ledger", {"account": account})
    assert out["status"] == "error" and out["error"] == "RuntimeError", out
    assert out["retryable"] is True
    shown = json.dumps(out)
    for secret in ("hunter2", "postgresql://", "sk_live", "db.internal", account):
        assert secret not in shown, shown
    # The model gets an id to quote; the log has the whole text under the same id
    error_id = out["error_id"]
    assert error_id in out["message"]
    logged = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
    assert logged and "hunter2@db.internal" in logged[0] and f"sk_live_51Hx{account}" in logged[0]
    assert live.effects(f"sync:{account}") == ["1"]


def test_a_terminal_or_exposed_error_is_shown_and_others_are_not(live: Env) -> None:
    tools, oid = box(), order()
    terminal = tools.call("refund", {"charge_id": f"ch_{oid}"})
    assert f"charge ch_{oid} was already refunded" in terminal["message"], terminal
    assert "error_id" not in terminal
    exposed = tools.call("charge_declined", {"order_id": oid})
    assert exposed["error"] == "CardDeclined", exposed
    assert f"card ending 4242 declined for {oid}" in exposed["message"]
    # The same failure through a tool that does not expose it: type and id only
    quiet = tools.call("charge_declined_quiet", {"order_id": order()})
    assert quiet["error"] == "CardDeclined" and "4242" not in quiet["message"], quiet
    assert quiet["error_id"] in quiet["message"]
    # A class marked expose_to_model = True is shown by every tool
    marked = tools.call("over_quota", {"order_id": oid})
    assert f"daily quota of 100 calls used up ({oid})" in marked["message"], marked


def test_a_read_functions_error_text_is_not_shown_either(
        live: Env, caplog: pytest.LogCaptureFixture) -> None:
    def lookup(order_id: str) -> None:
        """Look up an order."""
        raise ConnectionError("redis://:s3cret@cache.internal:6379/0 refused")

    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        out = tool(lookup, kind="read")(order_id="o1")
    assert out["error"] == "ConnectionError" and "s3cret" not in json.dumps(out), out
    assert any(out["error_id"] in r.getMessage() and "s3cret" in r.getMessage()
               for r in caplog.records)


# -- hostile arguments --------------------------------------------------------------------------


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


def _invalid(out: dict[str, Any]) -> None:
    assert out["status"] == "error" and out["error"] == "InvalidArguments", out
    assert "Nothing was done" in out["message"] and out["task_id"] is None


def test_deep_or_huge_arguments_are_invalid_not_an_exception(live: Env) -> None:
    tools, oid = box(), order()
    # JSON text nested 100,000 deep (json.loads raised RecursionError here)
    _invalid(tools.call("charge_card", "[" * 100_000 + "]" * 100_000))
    _invalid(tools.call("charge_card", '{"order_id": ' + "[" * 100_000 + "]" * 100_000 + "}"))
    # The same as a mapping (Anthropic's input, MCP's arguments), past the depth limit
    _invalid(tools.call("charge_card", {"order_id": _deep(100_000), "amount_cents": 1}))
    _invalid(tools.call("charge_card", {"order_id": _deep(MAX_ARGUMENT_DEPTH), "amount_cents": 1}))
    # Too large, as text and as a mapping
    _invalid(tools.call("charge_card", json.dumps({"order_id": "o" * MAX_ARGUMENTS_SIZE,
                                                   "amount_cents": 1})))
    _invalid(tools.call("charge_card", {"order_id": oid, "amount_cents": 1,
                                        "currency": ["usd"] * MAX_ARGUMENTS_SIZE}))
    # Not valid Unicode, not JSON, not UTF-8
    _invalid(tools.call("charge_card", '{"order_id": "\\ud800", "amount_cents": 1}'))
    _invalid(tools.call("charge_card", b'{"order_id": "\xff", "amount_cents": 1}'))
    _invalid(asyncio.run(tools.acall("charge_card", "[" * 100_000)))
    # Within the bounds, a call still works
    ok = tools.call("charge_card", json.dumps({"order_id": oid, "amount_cents": 1}))
    assert ok["status"] == "ok", ok
    assert len(live.effects(f"charge:{oid}")) == 1


def test_a_failure_while_checking_arguments_is_invalid(live: Env,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the schema check raises on a hostile input, the model gets an outcome
    import celery_idem.contrib.tools.runtime as runtime

    def broken(schema: Any, value: Any, path: str = "") -> list[str]:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(runtime, "validate", broken)
    oid = order()
    _invalid(box().call("charge_card", {"order_id": oid, "amount_cents": 1}))
    assert live.effects(f"charge:{oid}") == []
