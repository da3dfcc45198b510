"""The example's tools over MCP: an MCP client's repeated and concurrent calls, one charge.

    python -m example_app.mcp_demo          # embedded: SQLite files, no server needed

It starts the provider and a ``celery worker`` (as ``example_app.demo`` does), then the MCP
server exactly as a user's MCP client configuration starts it::

    celery -A example_app.celery_app idem mcp --toolbox example_app.agent:mcp_tools

and connects the official MCP client to it over stdio. The client calls ``charge_card`` for
one order twice in a row, and for another order twice at once, with a provider that ignores
``Idempotency-Key`` (so only the gate stands between a repeat and a second charge). Then it
counts the charges in the *provider's* database and exits 0 only if each order has one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

from .demo import ROOT, cleanup_redis, configure, start_provider, start_worker, stop
from .payments import ProviderClient

#: The command an MCP client configuration runs (``python -m celery`` is ``celery``).
SERVER_ARGS = ["-m", "celery", "-A", "example_app.celery_app", "idem", "mcp",
               "--toolbox", "example_app.agent:mcp_tools"]


def server_params() -> StdioServerParameters:
    """The stdio server, with this run's settings (the MCP client passes few variables on)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("CELERY_", "EXAMPLE_"))}
    return StdioServerParameters(command=sys.executable, args=SERVER_ARGS, cwd=str(ROOT),
                                 env={**env, "PYTHONPATH": str(ROOT)})


async def converse(order_a: str, order_b: str, amount: int, say: Any) -> list[dict[str, Any]]:
    """The client's calls; returns each call's structured outcome."""
    outcomes: list[dict[str, Any]] = []
    async with Client(server_params()) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        hints = listed["charge_card"].annotations
        say(f"  tools    {', '.join(listed)} (charge_card: idempotentHint="
            f"{hints.idempotent_hint if hints else None})")
        arguments = {"order_id": order_a, "amount_cents": amount, "currency": "usd"}
        for n in (1, 2):  # the same call twice in a row (a client retrying after a hiccup)
            result = await client.call_tool("charge_card", arguments)
            outcomes.append(result.structured_content)
            say(f"  call {n}   charge_card({order_a}) -> {result.structured_content['status']}")
        arguments = {**arguments, "order_id": order_b}

        async def call(n: int) -> None:
            result = await client.call_tool("charge_card", arguments)
            outcomes.append(result.structured_content)
            say(f"  call {n}   charge_card({order_b}) -> {result.structured_content['status']} "
                f"(at once)")

        async with anyio.create_task_group() as tg:  # twice at once (two agent turns)
            tg.start_soon(call, 3)
            tg.start_soon(call, 4)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.mcp_demo",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--broker", help="broker URL (default: SQLite in a temporary directory)")
    parser.add_argument("--backend", help="result backend URL (default: SQLite, temporary)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    # What example_app.demo.configure reads; this demo always runs its own worker.
    args.store = None
    args.no_worker = False
    started, run_id = time.monotonic(), uuid.uuid4().hex[:6]
    tmp = Path(tempfile.mkdtemp(prefix="celery-idem-mcp-demo-"))
    settings = configure(args, tmp, run_id)

    def say(text: str) -> None:
        print(text, flush=True)

    say("celery_idem MCP demo: an MCP client calls charge_card again and at once")
    say(f"  server   celery {' '.join(SERVER_ARGS[2:])}  (stdio)")
    procs: list[subprocess.Popen[Any]] = []
    try:
        provider_proc, url = start_provider(f"sqlite:///{tmp}/provider.sqlite", "",
                                            tmp / "provider.log")
        procs.append(provider_proc)
        os.environ["EXAMPLE_PAYMENTS_URL"] = settings["EXAMPLE_PAYMENTS_URL"] = url
        procs.append(start_worker(run_id, "threads", 8, tmp / "worker.log"))
        provider = ProviderClient(url, timeout=2, retries=0)
        order_a, order_b = f"ord_{run_id}_mcp1", f"ord_{run_id}_mcp2"
        for order in (order_a, order_b):  # only the gate keeps a repeat from charging again
            provider.add_rule(order, "charges", keys=False)
        outcomes = anyio.run(converse, order_a, order_b, 4200, say)
        charges = {o: len(provider.charges_for(o)) for o in (order_a, order_b)}
    except (RuntimeError, OSError) as exc:
        print(f"FAIL: {exc}\nlogs: {tmp}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):
            stop(proc)
        cleanup_redis(settings)
    statuses = [o["status"] for o in outcomes]
    say(f"charges at the provider: {order_a}: {charges[order_a]}, {order_b}: {charges[order_b]}")
    ok = charges == {order_a: 1, order_b: 1} and statuses[:2] == ["ok", "duplicate"] \
        and sorted(statuses[2:]) == ["duplicate", "ok"]
    elapsed = time.monotonic() - started
    if not ok:
        say(f"FAIL after {elapsed:.1f} s: statuses {statuses}; logs: {tmp}")
        return 1
    say(f"PASS in {elapsed:.1f} s: 4 calls over MCP, 2 orders, 1 charge each (the repeats "
        f"were answered 'duplicate' with the first charge)")
    if args.keep:
        say(f"logs: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
