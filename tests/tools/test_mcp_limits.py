"""The MCP HTTP server's limits, tenants and authorization, against a real server.

Limits: each principal's open sessions and request rate are its own (429 beyond them), idle
sessions close. Tenants: a token names its principal and its scope, so two principals can
share one tenant, and a one-tenant deployment's stdio and HTTP calls share a key. Authorization:
the toolbox's ``authorize`` hook refuses a call before anything is enqueued.

Servers are the user's command (``celery -A tests.tools.app idem mcp --http``) in its own
process, or :func:`http_app` under uvicorn in this process on a free port; clients are plain
HTTP (httpx2) or the official MCP client.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import uvicorn
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from celery_idem import IdempotentTask
from celery_idem.contrib.mcp import TOKENS_ENV, StaticTokens, http_app, server
from celery_idem.contrib.tools import Toolbox, tool
from tests.integration.harness import ROOT, free_port, wait_for
from tests.tools import app as app_module
from tests.tools.app import charge_card
from tests.tools.conftest import Env
from tests.tools.support import command, server_env
from tests.tools.test_mcp_http import INITIALIZE, STEP, mcp_http, post, started

pytestmark = pytest.mark.worker

TOKENS = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}


def bearer(principal: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[principal]}"}


@contextmanager
def serving(toolbox: Toolbox, tokens: str | None = None, **limits: Any) -> Iterator[str]:
    """:func:`http_app` of ``toolbox`` under uvicorn in a thread; yields its URL."""
    port = free_port()
    verifier = StaticTokens.from_text(tokens) if tokens else None
    app = http_app(server(toolbox), "127.0.0.1", port, token_verifier=verifier, **limits)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: uv.started, timeout=STEP, what="uvicorn")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        uv.should_exit = True
        thread.join(STEP)


def two_tokens() -> str:
    return ",".join(f"{p}:{t}" for p, t in TOKENS.items())


def test_a_principal_at_its_session_cap_gets_429_and_another_still_initializes() -> None:
    with serving(Toolbox([]), two_tokens(), principal_sessions=3, max_sessions=10,
                 rate_limit=None) as url:
        opened = [post(url, bearer("alice")) for _ in range(3)]
        assert [r.status_code for r in opened] == [200, 200, 200]
        refused = post(url, bearer("alice"))
        assert refused.status_code == 429, refused.text
        assert "open sessions" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"]
        # Another principal is not affected by alice's cap
        assert post(url, bearer("bob")).status_code == 200
        # A session alice closes frees its slot
        sid = opened[0].headers["mcp-session-id"]
        closed = httpx2.delete(url, headers={**bearer("alice"), "mcp-session-id": sid},
                               timeout=STEP)
        assert closed.status_code < 300, closed.text
        assert post(url, bearer("alice")).status_code == 200


def test_an_idle_session_closes_and_frees_its_slot() -> None:
    with serving(Toolbox([]), two_tokens(), principal_sessions=1, session_idle_timeout=1.0,
                 rate_limit=None) as url:
        first = post(url, bearer("alice"))
        assert first.status_code == 200
        assert post(url, bearer("alice")).status_code == 429
        # Once the idle timeout closes the session, alice may open another
        wait_for(lambda: post(url, bearer("alice")).status_code == 200, timeout=STEP,
                 what="the idle session to close")
        old = httpx2.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "ping"}, timeout=STEP,
                          headers={**bearer("alice"), "mcp-session-id":
                                   first.headers["mcp-session-id"],
                                   "Accept": "application/json, text/event-stream"})
        assert old.status_code == 404


def test_a_principal_over_its_request_rate_gets_429_and_another_does_not() -> None:
    # 0.2 requests per second: a burst of one, so alice's second request within 5 s is refused
    with serving(Toolbox([]), two_tokens(), rate_limit=0.2) as url:
        statuses = [post(url, bearer("alice")) for _ in range(3)]
        assert statuses[0].status_code == 200
        refused = [r for r in statuses[1:] if r.status_code == 429]
        assert refused, [r.status_code for r in statuses]
        assert "request rate" in refused[0].json()["error"]["message"]
        assert int(refused[0].headers["retry-after"]) >= 1
        assert post(url, bearer("bob")).status_code == 200


def test_the_commands_session_options_cap_one_principal_and_not_another(
        live: Env, tmp_path: Path) -> None:
    port = free_port()
    options = ("--principal-sessions", "2", "--max-sessions", "3", "--session-idle-timeout", "5",
               "--rate-limit", "1000")
    with mcp_http(live, tmp_path, "127.0.0.1", port, {TOKENS_ENV: two_tokens()},
                  *options) as proc:
        started(proc, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/mcp"
        alice = [post(url, bearer("alice")) for _ in range(3)]
        assert [r.status_code for r in alice] == [200, 200, 429], [r.text for r in alice]
        assert "open sessions" in alice[2].json()["error"]["message"]
        # alice at her cap leaves bob his share; the cap of all sessions (3) is the SDK's 503
        assert post(url, bearer("bob")).status_code == 200
        assert post(url, bearer("bob")).status_code == 503
        # The idle timeout (5 s, not the default 600 s) closes alice's sessions
        wait_for(lambda: post(url, bearer("alice")).status_code == 200, timeout=30,
                 what="alice's idle sessions to close")


def test_the_commands_rate_limit_is_per_principal(live: Env, tmp_path: Path) -> None:
    port = free_port()
    with mcp_http(live, tmp_path, "127.0.0.1", port, {TOKENS_ENV: two_tokens()},
                  "--rate-limit", "0.2") as proc:  # a burst of one, then one per 5 s
        started(proc, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/mcp"
        first, second = post(url, bearer("alice")), post(url, bearer("alice"))
        assert (first.status_code, second.status_code) == (200, 429), second.text
        assert "request rate" in second.json()["error"]["message"]
        assert post(url, bearer("bob")).status_code == 200


def test_a_request_body_over_a_mebibyte_is_refused() -> None:
    # The SDK accepts 4 MiB per request; the server keeps a session's requests to 1 MiB each.
    big = {**INITIALIZE, "params": {**INITIALIZE["params"],
                                    "clientInfo": {"name": "x" * (2 << 20), "version": "1"}}}
    with serving(Toolbox([]), two_tokens()) as url:
        refused = httpx2.post(url, json=big, timeout=STEP, headers={
            **bearer("alice"), "Accept": "application/json, text/event-stream"})
        assert refused.status_code == 413, refused.status_code
        assert post(url, bearer("alice")).status_code == 200


def test_the_stdio_start_up_line_names_its_scope(live: Env) -> None:
    # stdin at its end: the server announces itself, then ends with its client
    proc = subprocess.run([sys.executable, *command()], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, env={**os.environ, **server_env(live)},
                          timeout=STEP, check=False)
    assert proc.returncode == 0, proc.stderr
    assert b"on stdio; scope: none" in proc.stderr, proc.stderr


def test_an_error_while_a_write_tool_starts_reaches_an_mcp_client_redacted(
        idle: Env, caplog: pytest.LogCaptureFixture) -> None:
    secret = "postgresql://app:s3cret-pw@db.internal/prod"

    def key_func(order_id: str) -> str:
        raise ValueError(f"could not look up {order_id} at {secret}")

    @app_module.app.task(base=IdempotentTask, shared=False, name="tools.leaky_over_mcp",
                         idempotency_key_func=key_func)
    def leaky(order_id: str) -> Any:
        return order_id

    async def call() -> tuple[dict[str, Any], str]:
        async with httpx2.AsyncClient(headers=bearer("alice"), timeout=STEP) as http, \
                Client(streamable_http_client(url, http_client=http)) as client:
            result = await client.call_tool("leaky_over_mcp", {"order_id": "o-1"})
            assert result.structured_content is not None
            return result.structured_content, str(result.content)

    with serving(Toolbox([tool(leaky)]), two_tokens()) as url, \
            caplog.at_level(logging.WARNING, logger="celery_idem"):
        out, text = anyio.run(call)
    assert out["status"] == "error" and out["error"] == "ValueError", out
    assert out["error_id"] and out["error_id"] in out["message"]
    for seen in (str(out), text):
        assert "s3cret" not in seen and "db.internal" not in seen, seen
    logged = [r.getMessage() for r in caplog.records if out["error_id"] in r.getMessage()]
    assert logged and secret in logged[0]  # the detail is in the server's log
    assert idle.queued() == 0


def test_the_limits_are_checked() -> None:
    for limits, problem in [({"principal_sessions": 5, "max_sessions": 4}, "max_sessions"),
                            ({"principal_sessions": 0}, "principal_sessions"),
                            ({"rate_limit": 0.0}, "rate_limit"),
                            ({"rate_limit": float("nan")}, "rate_limit")]:
        with pytest.raises(ValueError, match=problem):
            http_app(server(Toolbox([])), "127.0.0.1", 1, **limits)


async def call_over_http(url: str, token: str, name: str, arguments: dict[str, Any]
                         ) -> dict[str, Any]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                  timeout=STEP) as http, \
            Client(streamable_http_client(url, http_client=http)) as client:
        result = await client.call_tool(name, arguments)
        assert result.structured_content is not None
        return result.structured_content


def test_two_principals_sharing_a_scope_are_one_tenant(live: Env, tmp_path: Path) -> None:
    port = free_port()
    env = {TOKENS_ENV: f"alice@shop:{TOKENS['alice']},bob@shop:{TOKENS['bob']}"}
    oid = f"ord_{uuid.uuid4().hex[:8]}"
    with mcp_http(live, tmp_path, "0.0.0.0", port, env) as proc:
        started(proc, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/mcp"

        async def main() -> list[dict[str, Any]]:
            with anyio.fail_after(4 * STEP):
                return [await call_over_http(url, TOKENS[p], "charge_card",
                                             {"order_id": oid, "amount_cents": 50})
                        for p in ("alice", "bob")]

        alice, bob = anyio.run(main)
    assert alice["status"] == "ok" and bob["status"] == "duplicate", (alice, bob)
    assert bob["task_id"] == alice["task_id"]
    assert alice["idempotency_key"] == charge_card.idempotency_key_for(
        kwargs={"order_id": oid, "amount_cents": 50}, idempotency_scope="shop")
    assert live.effects(f"charge:{oid}") == [alice["task_id"]]
    log = (tmp_path / f"mcp-{port}.log").read_text()
    assert "scope: alice in shop, bob in shop" in log, log


def test_one_tenant_stdio_and_http_calls_of_one_action_share_a_key(
        live: Env, tmp_path: Path) -> None:
    port = free_port()
    env = {TOKENS_ENV: f"support-bot@:{TOKENS['alice']}"}
    oid = f"ord_{uuid.uuid4().hex[:8]}"
    arguments = {"order_id": oid, "amount_cents": 60}
    stdio = StdioServerParameters(command=sys.executable, args=command(), env=server_env(live),
                                  cwd=str(ROOT))

    async def over_stdio() -> dict[str, Any]:
        with anyio.fail_after(4 * STEP):
            async with Client(stdio) as client:
                result = await client.call_tool("charge_card", arguments)
                assert result.structured_content is not None
                return result.structured_content

    local = anyio.run(over_stdio)
    with mcp_http(live, tmp_path, "0.0.0.0", port, env) as proc:
        started(proc, "127.0.0.1", port)
        remote = anyio.run(call_over_http, f"http://127.0.0.1:{port}/mcp", TOKENS["alice"],
                           "charge_card", arguments)
    assert local["status"] == "ok" and remote["status"] == "duplicate", (local, remote)
    assert remote["idempotency_key"] == local["idempotency_key"] == \
        charge_card.idempotency_key_for(kwargs={"order_id": oid, "amount_cents": 60})
    assert live.effects(f"charge:{oid}") == [local["task_id"]]
    assert "scope: support-bot in no scope" in (tmp_path / f"mcp-{port}.log").read_text()


def test_a_refused_start_prints_no_listening_line(live: Env, tmp_path: Path) -> None:
    port = free_port()
    with mcp_http(live, tmp_path, "0.0.0.0", port, {TOKENS_ENV: ""}) as proc:
        assert proc.wait(STEP) != 0
    text = (tmp_path / f"mcp-{port}.log").read_text()
    assert TOKENS_ENV in text and "MCP server:" not in text, text
    # Only the reason: no advice about Host names for a server that never listens.
    assert "accepts the Host names" not in text, text


def test_authorize_refuses_before_the_enqueue_with_a_forbidden_outcome(
        idle: Env, caplog: pytest.LogCaptureFixture) -> None:
    asked: list[tuple[Any, ...]] = []

    def authorize(principal: str | None, name: str, arguments: Any) -> bool:
        asked.append((principal, name, dict(arguments)))
        return principal == "alice" and arguments["amount_cents"] <= 100

    tools = Toolbox([tool(charge_card, timeout=0.2)], authorize=authorize)
    oid = f"ord_{uuid.uuid4().hex[:8]}"
    with serving(tools, two_tokens()) as url, caplog.at_level(logging.WARNING):
        def as_(principal: str, amount: int) -> dict[str, Any]:
            return anyio.run(call_over_http, url, TOKENS[principal], "charge_card",
                             {"order_id": oid, "amount_cents": amount})

        bob, too_much = as_("bob", 50), as_("alice", 500)
        assert idle.queued() == 0  # refused before anything was sent
        allowed = as_("alice", 50)
    for refused in (bob, too_much):
        assert refused["status"] == "forbidden" and refused["error"] == "Forbidden", refused
        assert refused["task_id"] is None and refused["idempotency_key"] is None
    assert allowed["status"] == "in_progress" and idle.queued() == 1  # nobody consumes it
    assert [a[:2] for a in asked] == [("bob", "charge_card"), ("alice", "charge_card"),
                                      ("alice", "charge_card")]
    assert asked[0][2] == {"order_id": oid, "amount_cents": 50}
    forbidden = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert len(forbidden) == 2 and "'bob'" in forbidden[0], forbidden


def test_a_raising_authorize_refuses(idle: Env) -> None:
    def broken(principal: str | None, name: str, arguments: Any) -> bool:
        raise RuntimeError("policy service down")

    tools = Toolbox([tool(charge_card, timeout=0.2)], authorize=broken)
    out = tools.call("charge_card", {"order_id": "o1", "amount_cents": 1})
    assert out["status"] == "forbidden" and idle.queued() == 0
    # Arguments that do not parse are the tool's invalid outcome; the hook is not asked
    assert tools.call("charge_card", "{not json")["status"] == "error"
    assert "not allowed" in out["message"]
