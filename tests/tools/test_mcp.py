"""The MCP server with the official MCP client: over stdio, over streamable HTTP, and in process.

The server is the command a user runs (``celery -A tests.tools.app idem mcp --toolbox
tests.tools.app:toolbox``); the tools' bodies run in the module's real ``celery worker`` and
append to the Redis ledger, which counts effects independently of the store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.server.lowlevel import Server
from mcp.types import REQUEST_TIMEOUT

from celery_idem.contrib.mcp import INSTRUCTIONS, load_toolbox, server, text_of
from celery_idem.contrib.tools import OUTCOME_SCHEMA
from celery_idem.records import State
from celery_idem.task import get_store
from tests.integration.harness import ROOT, free_port, wait_for
from tests.tools.app import charge_card, charge_with_key, toolbox
from tests.tools.conftest import Env
from tests.tools.support import command, server_env

pytestmark = pytest.mark.worker

#: Bound on any one step of a scenario (a loaded machine; never delays a passing test).
STEP = 60.0


def order() -> str:
    return f"ord_{uuid.uuid4().hex[:8]}"


async def claimed(key: str) -> None:
    """Wait (bounded) until the worker's body holds the claim of ``key``."""
    store = get_store(charge_card.app)
    await anyio.to_thread.run_sync(lambda: wait_for(
        lambda: (rec := store.get(key)) is not None and rec.state is State.IN_PROGRESS,
        timeout=STEP, what=f"the claim of {key}"))


def received_charges(live: Env) -> int:
    """``charge_card`` messages the module's worker has received so far (its log says so)."""
    assert live.worker is not None
    return len(re.findall(r"Task tests\.tools\.app\.charge_card\[[-0-9a-f]+\] received",
                          live.worker.text()))


async def scenario(client: Client, live: Env) -> None:
    """The issue's three repeats, each ending with one effect in the ledger."""
    listed = {t.name: t for t in (await client.list_tools()).tools}
    assert listed["charge_card"].annotations is not None
    assert listed["charge_card"].annotations.idempotent_hint is True
    assert listed["stock_level"].annotations.read_only_hint is True  # type: ignore[union-attr]

    # 1. Twice in a row: the second is a success carrying the first result.
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 500}
    first = await client.call_tool("charge_card", arguments)
    again = await client.call_tool("charge_card", arguments)
    assert first.structured_content["status"] == "ok", first
    assert again.structured_content["status"] == "duplicate", again
    assert again.is_error is False
    assert again.structured_content["result"] == first.structured_content["result"]
    # The key is the task's own for these business arguments (no request id in it).
    assert again.structured_content["idempotency_key"] == charge_card.idempotency_key_for(
        kwargs=arguments)
    assert "It was not done again" in again.content[0].text  # type: ignore[union-attr]
    assert live.effects(f"charge:{oid}") == [first.structured_content["task_id"]]

    # 2. Twice at once, while the body runs.
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 700, "hold": True}
    results: list[Any] = []

    async def call() -> None:
        results.append(await client.call_tool("charge_card", arguments))

    received = received_charges(live)
    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        tg.start_soon(call)
        # Both calls are in flight at the server: one message reached the worker (the other
        # call attached to it at enqueue), and its body holds the key.
        await anyio.to_thread.run_sync(lambda: wait_for(
            lambda: received_charges(live) >= received + 1, timeout=STEP,
            what="the message at the worker"))
        await claimed(charge_card.idempotency_key_for(kwargs=arguments))
        live.release(oid)
    statuses = sorted(r.structured_content["status"] for r in results)
    assert statuses == ["duplicate", "ok"], [r.structured_content for r in results]
    # One task: the second call followed the first's message instead of sending a copy
    assert received_charges(live) == received + 1
    assert results[0].structured_content["task_id"] == results[1].structured_content["task_id"]
    assert results[0].structured_content["result"] == results[1].structured_content["result"]
    assert len(live.effects(f"charge:{oid}")) == 1

    # 3. The client gives up waiting on a slow body, then calls again.
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 900, "hold": True}
    gave_up = await client.call_tool("charge_card_quick", arguments)
    out = gave_up.structured_content
    assert out["status"] == "in_progress" and gave_up.is_error is False, out
    assert "safe to call it again with the same arguments" in out["message"]
    assert "safe to call it again" in gave_up.content[0].text  # type: ignore[union-attr]
    await claimed(out["idempotency_key"])
    live.release(oid)
    later = await client.call_tool("charge_card", arguments)
    assert later.structured_content["status"] == "duplicate", later.structured_content
    assert later.structured_content["idempotency_key"] == out["idempotency_key"]
    assert later.structured_content["result"]["charge_id"] == f"ch_{oid}_900"
    assert live.effects(f"charge:{oid}") == [out["task_id"]]

    # 4. The client itself gives up (its read timeout: the request is cancelled at the server,
    #    which stops only the wait), then calls again.
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 950, "hold": True}
    key = charge_card.idempotency_key_for(kwargs=arguments)
    with pytest.raises(MCPError) as timed_out:
        await client.call_tool("charge_card", arguments, read_timeout_seconds=1.0)
    assert timed_out.value.error.code == REQUEST_TIMEOUT
    await claimed(key)  # the task runs on, and holds the key
    live.release(oid)
    retried = await client.call_tool("charge_card", arguments)
    assert retried.structured_content["status"] == "duplicate", retried.structured_content
    assert retried.structured_content["result"]["charge_id"] == f"ch_{oid}_950"
    assert len(live.effects(f"charge:{oid}")) == 1


def test_the_official_client_over_stdio_gets_one_effect_per_action(live: Env) -> None:
    params = StdioServerParameters(command=sys.executable, args=command(), env=server_env(live),
                                   cwd=str(ROOT))

    async def main() -> None:
        with anyio.fail_after(4 * STEP):
            async with Client(params) as client:
                await scenario(client, live)

    anyio.run(main)


@pytest.fixture
def http_server(live: Env, tmp_path: Path) -> Iterator[str]:
    """``idem mcp --http`` in its own process; yields the URL once the port answers."""
    port = free_port()
    log = (tmp_path / "mcp-http.log").open("w")
    proc = subprocess.Popen([sys.executable, *command("--http", f"127.0.0.1:{port}")],
                            cwd=ROOT, env={**os.environ, **server_env(live)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)

    def listening() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the MCP server exited: {(tmp_path / 'mcp-http.log').read_text()}")
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, timeout=STEP, what="the MCP HTTP server")
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_the_official_client_over_streamable_http_gets_one_effect_per_action(
    live: Env, http_server: str
) -> None:
    async def main() -> None:
        with anyio.fail_after(4 * STEP):
            async with Client(http_server) as client:
                await scenario(client, live)

    anyio.run(main)


def test_the_python_entry_point_returns_a_server_with_annotations_and_output_schema() -> None:
    mcp_server = server(toolbox, name="shop-tools")
    assert isinstance(mcp_server, Server) and mcp_server.name == "shop-tools"

    instructions: list[str | None] = []

    async def main() -> dict[str, Any]:
        async with Client(mcp_server) as client:
            instructions.append(client.instructions)
            return {t.name: t for t in (await client.list_tools()).tools}

    listed = anyio.run(main)
    assert instructions == [INSTRUCTIONS]
    charge = listed["charge_card"]
    assert charge.input_schema == toolbox["charge_card"].parameters
    assert charge.output_schema == OUTCOME_SCHEMA
    assert charge.description == toolbox["charge_card"].description
    hints = {n: t.annotations.model_dump(exclude_none=True)  # type: ignore[union-attr]
             for n, t in listed.items()}
    assert hints["charge_card"] == {"title": "Charge a card", "read_only_hint": False,
                                    "destructive_hint": False, "idempotent_hint": True,
                                    "open_world_hint": True}
    assert hints["refund"]["destructive_hint"] is True  # the tool() default
    assert hints["stock_level"] == {"read_only_hint": True, "open_world_hint": False}


def test_the_request_id_and_meta_of_a_call_are_not_part_of_the_key(live: Env) -> None:
    oid = order()
    arguments = {"order_id": oid, "amount_cents": 321}

    async def main() -> list[Any]:
        # Each call is its own JSON-RPC request (its own id), with its own _meta.
        async with Client(server(toolbox)) as client:
            return [await client.call_tool("charge_card", arguments,
                                           meta={"progress_token": f"p{n}", "trace": f"t{n}"})
                    for n in (1, 2)]

    first, second = anyio.run(main)
    assert [first.structured_content["status"], second.structured_content["status"]] == \
        ["ok", "duplicate"]
    assert first.structured_content["idempotency_key"] == \
        second.structured_content["idempotency_key"] == charge_card.idempotency_key_for(
            kwargs=arguments)
    assert len(live.effects(f"charge:{oid}")) == 1


def test_an_explicit_key_argument_is_the_callers_key_of_this_tool_only(live: Env) -> None:
    oid, key = order(), f"client-key-{uuid.uuid4().hex[:8]}"

    async def main() -> list[Any]:
        async with Client(server(toolbox)) as client:
            return [await client.call_tool("charge_with_key", {
                "order_id": oid, "amount_cents": cents, "request_key": key})
                for cents in (10, 10, 20)]

    first, again, other = anyio.run(main)
    assert first.structured_content["status"] == "ok", first.structured_content
    # The caller's key, in the task's namespace: it can name no other task's action
    assert first.structured_content["idempotency_key"] == charge_with_key.idempotency_key_for(
        kwargs={"order_id": oid, "amount_cents": 10}, idempotency_key=key)
    assert first.structured_content["result"]["key"] == first.structured_content["idempotency_key"]
    assert again.structured_content["status"] == "duplicate"
    # Same key, other arguments: another action under a used key, refused (a new key is needed)
    out = other.structured_content
    assert other.is_error is True and out["error"] == "IdempotencyKeyMismatch", out
    assert "Use a new key for a new action" in other.content[0].text  # type: ignore[union-attr]
    assert len(live.effects(f"keyed:{oid}")) == 1


def test_another_tools_key_as_a_key_argument_runs_this_tools_own_action(live: Env) -> None:
    oid = order()
    charge_args = {"order_id": oid, "amount_cents": 777}

    async def main() -> list[Any]:
        async with Client(server(toolbox)) as client:
            charge = await client.call_tool("charge_card", charge_args)
            # The agent passes charge_card's key, as the outcome showed it, to another tool
            stolen = charge.structured_content["idempotency_key"]
            keyed = await client.call_tool("charge_with_key", {
                "order_id": oid, "amount_cents": 1, "request_key": stolen})
            again = await client.call_tool("charge_card", charge_args)
            return [charge, keyed, again]

    charge, keyed, again = anyio.run(main)
    first = charge.structured_content
    assert first["status"] == "ok", first
    stolen = first["idempotency_key"]
    assert stolen == charge_card.idempotency_key_for(kwargs=charge_args)
    # The second tool ran its own action, under its own key (the stolen one in its namespace)
    out = keyed.structured_content
    assert out["status"] == "ok" and keyed.is_error is False, out
    own = charge_with_key.idempotency_key_for(kwargs={"order_id": oid, "amount_cents": 1},
                                              idempotency_key=stolen)
    assert own == f"{charge_with_key.name}:key={stolen}" and out["idempotency_key"] == own
    assert out["task_id"] != first["task_id"]
    assert out["result"] == {"order_id": oid, "amount_cents": 1, "key": own, "effects": 1}
    # And nothing of the charge's result reached the model
    text = keyed.content[0].text  # type: ignore[union-attr]
    assert f"ch_{oid}_777" not in json.dumps(out) and f"ch_{oid}_777" not in text
    assert live.effects(f"keyed:{oid}") == [own]
    # The charge's record is untouched: still its one charge
    assert again.structured_content["status"] == "duplicate", again.structured_content
    assert again.structured_content["result"] == first["result"]
    assert live.effects(f"charge:{oid}") == [first["task_id"]]


def test_the_text_content_carries_the_message_and_the_result() -> None:
    out = {"status": "ok", "message": "charge_card succeeded.", "result": {"id": "ch_1"}}
    assert text_of(out) == 'charge_card succeeded.\nResult: {"id": "ch_1"}'
    big = text_of({**out, "result": "x" * 2000})
    assert len(big) < 600 and big.endswith('..."') is False and big.endswith("...")
    assert json.loads(json.dumps(out)) == out


def test_the_toolbox_spec_is_checked() -> None:
    assert load_toolbox("tests.tools.app:toolbox") is toolbox
    assert len(load_toolbox("tests.tools.app:_toolbox")) == len(toolbox)  # a factory
    for bad, problem in [("tests.tools.app", "MODULE:NAME"), ("tests.tools.app:nope", "no attribute"),
                         ("tests.tools.app:charge_card", "not a celery_idem.contrib.tools.Toolbox")]:
        with pytest.raises(ValueError, match=problem):
            load_toolbox(bad)


def test_the_command_refuses_a_bad_http_address_and_a_bad_toolbox() -> None:
    base = [sys.executable, "-m", "celery", "-A", "tests.tools.app", "idem", "mcp"]
    bad_http = subprocess.run([*base, "--toolbox", "tests.tools.app:toolbox", "--http", "nohost"],
                              cwd=ROOT, capture_output=True, text=True, timeout=STEP)
    assert bad_http.returncode != 0 and "HOST:PORT" in bad_http.stderr
    bad_box = subprocess.run([*base, "--toolbox", "tests.tools.app:nope"], cwd=ROOT,
                             capture_output=True, text=True, timeout=STEP)
    assert bad_box.returncode == 2 and "no attribute 'nope'" in bad_box.stderr


def test_every_spelling_of_a_number_is_one_charge_over_mcp(live: Env) -> None:
    oid = order()

    async def main() -> list[Any]:
        async with Client(server(toolbox)) as client:
            return [await client.call_tool("charge_card", {"order_id": oid, "amount_cents": n})
                    for n in (4200, 4200.0, "4200")]

    first, as_float, as_text = anyio.run(main)
    assert first.structured_content["status"] == "ok", first.structured_content
    # 4200.0 is the same number: the same action, answered from the first call
    assert as_float.structured_content["status"] == "duplicate", as_float.structured_content
    assert as_float.structured_content["idempotency_key"] == \
        first.structured_content["idempotency_key"]
    assert as_float.structured_content["result"]["amount_cents"] == 4200
    # "4200" is text, refused before anything is sent, with the type the model must send
    assert as_text.is_error is True
    assert "argument 'amount_cents' must be integer (a JSON number, not text)" in as_text.content[0].text  # type: ignore[union-attr]
    assert live.effects(f"charge:{oid}") == [first.structured_content["task_id"]]
