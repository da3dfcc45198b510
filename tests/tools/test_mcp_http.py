"""The MCP server exposed over HTTP: the Host/Origin allow-list on every bind, bearer
tokens required off loopback, each caller's principal as its scope, and no failure text.

The server is the command a user runs (``celery -A tests.tools.app idem mcp --http ...``) in its
own process; requests are plain HTTP (httpx2) or the official MCP client with a bearer header;
the bodies run in the module's real ``celery worker``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.provider import AccessToken
from mcp.types import LATEST_PROTOCOL_VERSION

from celery_idem.contrib.mcp import TOKENS_ENV, StaticTokens, scope_of, server
from tests.integration.harness import ROOT, free_port, wait_for
from tests.tools.app import charge_with_key, toolbox
from tests.tools.conftest import Env
from tests.tools.support import command, server_env

pytestmark = pytest.mark.worker

#: Bound on any one step (a loaded machine; never delays a passing test).
STEP = 60.0

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": LATEST_PROTOCOL_VERSION, "capabilities": {},
                         "clientInfo": {"name": "probe", "version": "1"}}}


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@contextmanager
def mcp_http(live: Env, tmp_path: Path, bind: str, port: int,
             env: dict[str, str] | None = None, *options: str
             ) -> Iterator[subprocess.Popen[bytes]]:
    """``idem mcp --http BIND:PORT [OPTIONS]`` in its own process, stopped on exit."""
    log_path = tmp_path / f"mcp-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, *command("--http", f"{bind}:{port}", *options)], cwd=ROOT,
                                env={**os.environ, **server_env(live), **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def started(proc: subprocess.Popen[bytes], host: str, port: int) -> None:
    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the MCP server exited with {proc.returncode}")
        return listening(host, port)

    wait_for(up, timeout=STEP, what="the MCP HTTP server")


def post(url: str, headers: dict[str, str] | None = None) -> httpx2.Response:
    return httpx2.post(url, json=INITIALIZE, timeout=STEP, headers={
        "Accept": "application/json, text/event-stream", **(headers or {})})


def test_a_loopback_bind_refuses_a_foreign_host_and_origin(live: Env, tmp_path: Path) -> None:
    # 127.0.0.2 is loopback, but not one of the three spellings the SDK protected
    port = free_port()
    with mcp_http(live, tmp_path, "127.0.0.2", port) as proc:
        started(proc, "127.0.0.2", port)
        url = f"http://127.0.0.2:{port}/mcp"
        assert post(url, {"Host": "attacker.example"}).status_code == 421
        assert post(url, {"Host": f"attacker.example:{port}"}).status_code == 421
        assert post(url, {"Origin": "http://attacker.example"}).status_code == 403
        # The address it is bound to, and the loopback names, are served
        assert post(url).status_code == 200
        assert post(url, {"Host": f"localhost:{port}",
                          "Origin": f"http://localhost:{port}"}).status_code == 200


def test_a_non_loopback_bind_without_tokens_refuses_to_start(live: Env, tmp_path: Path) -> None:
    port = free_port()
    for env, problem in [({TOKENS_ENV: ""}, TOKENS_ENV),
                         ({TOKENS_ENV: "alice:short"}, "shorter than"),
                         ({TOKENS_ENV: f"al ice@x:{secrets.token_urlsafe(32)}"}, "not PRINCIPAL")]:
        with mcp_http(live, tmp_path, "0.0.0.0", port, env) as proc:
            try:
                code = proc.wait(STEP)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the server started on 0.0.0.0 with {env}") from None
            text = (tmp_path / f"mcp-{port}.log").read_text()
            assert code != 0 and problem in text, text
            assert "Traceback" not in text, text  # one line naming what to set
            assert not listening("127.0.0.1", port)


@pytest.fixture
def tokens() -> dict[str, str]:
    return {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}


def test_off_loopback_a_bearer_token_is_required_and_its_principal_is_the_scope(
        live: Env, tmp_path: Path, tokens: dict[str, str]) -> None:
    port = free_port()
    env = {TOKENS_ENV: ",".join(f"{p}:{t}" for p, t in tokens.items())}
    oid, key = f"ord_{uuid.uuid4().hex[:8]}", f"k-{uuid.uuid4().hex[:8]}"
    arguments = {"order_id": oid, "amount_cents": 70, "request_key": key}
    with mcp_http(live, tmp_path, "0.0.0.0", port, env) as proc:
        started(proc, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/mcp"
        # No token, an unknown token, a token with a foreign Host: refused before any tool
        assert post(url).status_code == 401
        assert post(url, {"Authorization": "Bearer " + "x" * 40}).status_code == 401
        assert post(url, {"Authorization": f"Bearer {tokens['alice']}",
                          "Host": "attacker.example"}).status_code == 421

        async def call_as(principal: str) -> dict[str, Any]:
            headers = {"Authorization": f"Bearer {tokens[principal]}"}
            async with httpx2.AsyncClient(headers=headers, timeout=STEP) as http, \
                    Client(streamable_http_client(url, http_client=http)) as client:
                result = await client.call_tool("charge_with_key", arguments)
                assert result.structured_content is not None
                return result.structured_content

        async def main() -> list[dict[str, Any]]:
            with anyio.fail_after(4 * STEP):
                return [await call_as(p) for p in ("alice", "bob", "alice")]

        alice, bob, alice_again = anyio.run(main)
    # The same key and arguments from two callers: two actions, each in its caller's scope
    assert alice["status"] == bob["status"] == "ok", (alice, bob)
    assert alice["idempotency_key"] == charge_with_key.idempotency_key_for(
        kwargs={"order_id": oid, "amount_cents": 70}, idempotency_key=key,
        idempotency_scope="alice")
    assert "@bob:" in bob["idempotency_key"]
    assert alice_again["status"] == "duplicate" and alice_again["task_id"] == alice["task_id"]
    assert sorted(live.effects(f"keyed:{oid}")) == sorted([alice["idempotency_key"],
                                                            bob["idempotency_key"]])


def test_a_tool_failure_over_mcp_shows_no_error_text(live: Env) -> None:
    account = f"acct{uuid.uuid4().hex[:6]}"

    async def main() -> Any:
        async with Client(server(toolbox)) as client:
            return await client.call_tool("sync_ledger", {"account": account})

    result = anyio.run(main)
    out = result.structured_content
    assert result.is_error is True and out["error"] == "RuntimeError", out
    shown = json.dumps(out) + result.content[0].text  # type: ignore[union-attr]
    for secret in ("hunter2", "postgresql://", "sk_live", account):
        assert secret not in shown, shown
    assert out["error_id"] in result.content[0].text  # type: ignore[union-attr]


def test_static_tokens_map_each_token_to_its_principal() -> None:
    alice, bob = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    verifier = StaticTokens.from_text(f"alice:{alice}, tenant-42/bob:{bob}\n")
    assert len(verifier) == 2
    found = anyio.run(verifier.verify_token, bob)
    assert found is not None and scope_of(found) == "tenant-42/bob"
    assert anyio.run(verifier.verify_token, alice + "x") is None
    # A token may name its scope: shared by several principals, or none (the toolbox's)
    shared = StaticTokens.from_text(f"alice@shop:{alice} bob@shop:{bob} ops@:{'o' * 30}")
    assert shared.scopes() == {"alice": "shop", "bob": "shop", "ops": None}
    found = anyio.run(shared.verify_token, bob)
    assert found is not None and scope_of(found) == "shop" and found.client_id == "bob"
    for bad, problem in [("alice", r"PRINCIPAL\[@SCOPE\]:TOKEN"), (f"a b:{alice}", "not PRINCIPAL"),
                         (f"alice@sh!op:{alice}", "scope 'sh!op'"),
                         (f"al!ce:{alice}", "character"), ("alice:tooshort", "shorter"),
                         (f"alice:{alice},bob:{alice}", "repeats")]:
        with pytest.raises(ValueError, match=problem):
            StaticTokens.from_text(bad)
    # A verifier's token without a usable client id, or with a subject, gets a hashed scope
    hashed = scope_of(AccessToken(token="t", client_id="app one", scopes=[], subject="u1"))
    assert hashed.startswith("p.") and len(hashed) == 34
    assert hashed != scope_of(AccessToken(token="t", client_id="app one", scopes=[],
                                          subject="u2"))
