"""``await tool.acall(...)``: the event loop keeps running, and cancelling leaves the action alone.

A real ``celery worker`` runs the bodies (one per module, see conftest); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from celery_idem.contrib.tools import Toolbox, tool
from celery_idem.records import State
from celery_idem.task import get_store
from tests.integration.harness import wait_for
from tests.tools.app import charge_card
from tests.tools.conftest import Env

pytestmark = pytest.mark.worker

WAIT = 60.0
#: Seconds the test keeps a body held while a call awaits it.
HOLD = 1.5


def order() -> str:
    return f"ord_{uuid.uuid4().hex[:8]}"


async def until(predicate: object, what: str, timeout: float = WAIT) -> None:
    """Poll a blocking predicate in a thread, on a deadline."""
    await asyncio.to_thread(wait_for, predicate, timeout, 0.02, what)  # type: ignore[arg-type]


def is_claimed(key: str) -> bool:
    rec = get_store(charge_card.app).get(key)
    return rec is not None and rec.state is State.IN_PROGRESS


def test_awaiting_a_held_charge_does_not_block_the_event_loop(live: Env) -> None:
    oid = order()
    charge = tool(charge_card, timeout=WAIT)
    arguments = {"order_id": oid, "amount_cents": 300, "hold": True}
    key = charge_card.idempotency_key_for(kwargs=arguments)
    gaps: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        # A loop that another coroutine blocked would show a gap as long as the block.
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def main() -> dict[str, object]:
        stop = asyncio.Event()
        ticks = asyncio.create_task(ticker(stop))
        call = asyncio.create_task(charge.acall(**arguments))
        await until(lambda: is_claimed(key), "the claim")
        held_from = len(gaps)
        await asyncio.sleep(HOLD)  # the body is held: the call is waiting all this time
        assert not call.done()
        assert len(gaps) - held_from >= 10, "the loop did not run while the call waited"
        live.release(oid)
        out = await asyncio.wait_for(call, WAIT)
        stop.set()
        await ticks
        return out

    out = asyncio.run(main())
    assert out["status"] == "ok", out
    # 10 ms ticks. A call that blocked the loop would stop this coroutine from releasing the
    # body at all: the gap would be the call's whole wait (60 s). The bound leaves room for a
    # machine so loaded that the loop is not scheduled for a while.
    assert max(gaps) < HOLD, f"the longest event-loop gap was {max(gaps):.3f} s"
    assert len(live.effects(f"charge:{oid}")) == 1


def test_a_cancelled_await_leaves_the_task_running_and_a_later_call_gets_its_result(
    live: Env,
) -> None:
    oid = order()
    tools = Toolbox([tool(charge_card, timeout=WAIT)])
    arguments = {"order_id": oid, "amount_cents": 400, "hold": True}
    key = charge_card.idempotency_key_for(kwargs=arguments)

    async def main() -> dict[str, object]:
        call = asyncio.create_task(tools.acall("charge_card", arguments))
        await until(lambda: is_claimed(key), "the claim")
        # When the agent's coroutine is cancelled (a turn aborted, a client hung up)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # Then the task goes on and its key stays claimed
        assert is_claimed(key)
        assert live.effects(f"charge:{oid}") == []
        live.release(oid)
        await until(lambda: live.effects(f"charge:{oid}"), "the charge")
        # and a later call gets the action's result without doing it again
        return await tools.acall("charge_card", arguments)

    out = asyncio.run(main())
    assert out["status"] == "duplicate", out
    assert out["result"]["charge_id"] == f"ch_{oid}_400"  # type: ignore[index]
    assert len(live.effects(f"charge:{oid}")) == 1


def test_many_awaits_at_once_share_the_loop_and_the_action(live: Env) -> None:
    oid = order()
    charge = tool(charge_card, timeout=WAIT)
    arguments = {"order_id": oid, "amount_cents": 800}

    async def main() -> list[dict[str, object]]:
        return list(await asyncio.gather(*(charge.ainvoke(arguments) for _ in range(5))))

    outs = asyncio.run(main())
    assert sorted({str(o["status"]) for o in outs}) in (["duplicate", "ok"], ["duplicate"]), outs
    assert [o["status"] for o in outs].count("ok") <= 1
    assert len({str(o["result"]) for o in outs}) == 1
    assert len(live.effects(f"charge:{oid}")) == 1


def test_async_errors_are_outcomes_like_sync_ones(live: Env) -> None:
    tools = Toolbox([tool(charge_card, timeout=WAIT)])
    oid = order()

    async def main() -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
        return (await tools.acall("nope", {}),
                await tools.acall("charge_card", '{"order_id": 1}'),
                await tool(charge_card, timeout=0.2).ainvoke(
                    {"order_id": oid, "amount_cents": 1, "hold": True}))

    unknown, invalid, waiting = asyncio.run(main())
    live.release(oid)  # so the held body ends before the worker is stopped
    assert unknown["error"] == "UnknownTool"
    assert invalid["error"] == "InvalidArguments"
    assert waiting["status"] == "in_progress" and "after 0.2 s" in str(waiting["message"])
