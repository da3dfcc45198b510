"""The tool's caller reaches the body, and every error the model sees at enqueue is redacted."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_idem import IdempotentTask, InvalidKey
from celery_idem.contrib.tools import Toolbox, tool
from tests.tools import app as app_module
from tests.tools.conftest import Env

SECRET = "postgresql://app:s3cret-pw@db.internal/prod"


def test_the_body_and_its_children_see_the_callers_principal_and_scope(live: Env) -> None:
    place = tool(app_module.place_order, timeout=30)
    calls = [("alice-bot", "acme"), ("bob-bot", "globex")]
    outs = [place.invoke({"order_id": "o-77"}, scope=scope, principal=principal)
            for principal, scope in calls]
    for (principal, scope), out in zip(calls, outs, strict=True):
        assert out["status"] == "ok", out
        assert out["result"]["principal"] == principal and out["result"]["scope"] == scope
        child = app_module.app.AsyncResult(out["result"]["child_id"]).get(timeout=30)
        assert child == {"principal": principal, "scope": scope}
    assert sorted(live.effects("whoami:o-77")) == ["acme", "globex"]  # one child per tenant
    with pytest.raises(InvalidKey, match="principal"):
        place.invoke({"order_id": "o-78"}, principal="bob\n[forged]")


def test_a_toolbox_passes_its_callers_principal_to_the_body(live: Env) -> None:

    box = Toolbox([tool(app_module.place_order, timeout=30)])
    out = box.call("place_order", {"order_id": "o-79"}, scope="acme", principal="carol-bot")
    assert out["status"] == "ok", out
    assert out["result"]["principal"] == "carol-bot" and out["result"]["scope"] == "acme"


@pytest.mark.parametrize("error", [TypeError, ValueError])
def test_an_error_while_a_write_tool_starts_is_redacted(
    idle: Env, caplog: pytest.LogCaptureFixture, error: type[Exception],
) -> None:
    def key_func(order_id: str) -> str:
        raise error(f"could not look up {order_id} at {SECRET}")

    @app_module.app.task(base=IdempotentTask, shared=False, name=f"tools.leaky_{error.__name__}",
                         idempotency_key_func=key_func)
    def leaky(order_id: str) -> Any:
        return order_id

    with caplog.at_level(logging.WARNING, logger="celery_idem"):
        out = tool(leaky).invoke({"order_id": "o-1"})
    assert out["status"] == "error" and out["error"] == error.__name__, out
    assert out["error_id"] and out["error_id"] in out["message"]
    assert "s3cret" not in str(out) and "db.internal" not in str(out)
    assert out["retryable"] is False
    logged = [r.getMessage() for r in caplog.records if out["error_id"] in r.getMessage()]
    assert logged and SECRET in logged[0]  # the detail is in the server's log
    assert idle.queued() == 0
