"""A small tool-calling agent with a checkpoint, and a scripted "model" that drives it.

No model service is reachable here, so :class:`ScriptedModel` plays the LLM: given the
conversation so far and the tool list, it returns the next tool call or a final reply, as a
chat-completions client would. A real LLM client can replace it by implementing
:meth:`ScriptedModel.next_step` with the same arguments and return values.

Tools are tagged ``read`` (run in the agent process, safe to repeat: ``lookup_order``) or
``write`` (a Celery task: ``charge_card``, ``create_shipment``, ``send_email``). The write tools
come in two variants: ``idempotent`` (:mod:`example_app.tasks`, made into agent tools by
:func:`celery_idem.contrib.tools.tool`) and ``naive`` (:mod:`example_app.naive`, wrapped by
:class:`NaiveTool`, what a runtime without the adapter does). Either way the model sees a tool
result dict with a ``status``: ``ok``, ``duplicate`` (the action had already been done: its
result), ``in_progress`` (the wait ran out; calling again is safe) or ``error``.

The runtime saves the conversation to a checkpoint file after every step, and *before* it
enqueues a tool call. If the process dies, a new one started with the same checkpoint resumes:
a tool call without a result is issued again (the same tool, the same arguments).

Run one conversation::

    python -m example_app.agent --order ord_1 --variant idempotent --checkpoint /tmp/ord_1.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from celery.exceptions import TimeoutError as ResultTimeout

from celery_idem.contrib.tools import Toolbox, tool

Message = dict[str, Any]


# --------------------------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------------------------


Outcome = dict[str, Any]


class NaiveTool:
    """A write tool on a plain Celery task, as an agent runtime without celery_idem runs it.

    Same interface as :class:`celery_idem.contrib.tools.Tool` (``start`` then ``wait``), so the
    runtime below treats both alike. A wait that runs out is reported as an error, as most
    runtimes do: the model cannot know whether calling again is safe (here it is not).
    """

    kind = "write"

    def __init__(self, name: str, task: Any) -> None:
        self.name = name
        self.task = task

    def start(self, arguments: dict[str, Any]) -> NaivePending:
        # Read before the publish: the task cannot finish before it was sent, so a task that
        # takes longer than the budget can never look as if it had finished within it.
        started = time.monotonic()
        return NaivePending(self.name, self.task.apply_async(kwargs=arguments), started)


class NaivePending:
    """A started naive call: the task id, and no idempotency key.

    The budget of :meth:`wait` runs from the call (``started``, taken before the enqueue),
    not from when ``wait`` is reached: on a busy machine the enqueue itself may return only
    after the task has finished.
    """

    idempotency_key = None
    answered_at_enqueue = False

    def __init__(self, name: str, result: Any, started: float) -> None:
        self.name = name
        self.result = result
        self.task_id: str = result.id
        self.started = started

    def wait(self, timeout: float) -> Outcome:
        base = {"tool": self.name, "task_id": self.task_id, "idempotency_key": None}
        try:
            value = _result_within(self.result, self.started + timeout)
        except ResultTimeout:
            return {**base, "status": "error", "result": None, "error": "Timeout",
                    "retryable": True, "message": f"{self.name} gave no result within {timeout:g} s"}
        except Exception as exc:
            return {**base, "status": "error", "result": None, "error": type(exc).__name__,
                    "retryable": True, "message": f"{self.name} failed: {exc}"}
        return {**base, "status": "ok", "result": value, "message": f"{self.name} succeeded."}


def order_details(order_id: str) -> dict[str, Any]:
    """The shop's own record of an order (deterministic, so every process agrees)."""
    n = zlib.crc32(order_id.encode()) % 9000
    return {"order_id": order_id, "amount_cents": 1000 + n, "currency": "usd",
            "email": f"{order_id.replace('_', '.')}@customers.example",
            "address": f"{n % 97 + 1} Market Street, Springfield"}


def lookup_order(order_id: str) -> dict[str, Any]:
    """Read tool: the order, and the charges the payments provider already holds for it."""
    from .tasks import provider

    return {**order_details(order_id), "charges": provider().charges_for(order_id)}


def toolbox(variant: Literal["naive", "idempotent"]) -> dict[str, Any]:
    """The tools by name, with the write tools of ``variant``."""
    read = tool(lookup_order, kind="read")
    if variant == "idempotent":
        from . import tasks

        # The descriptions say what the model needs; tool() adds that a repeat is safe.
        box = Toolbox([
            read,
            tool(tasks.charge_card, description="Charge the customer's card for an order."),
            tool(tasks.create_shipment, description="Create the shipment of a paid order."),
            tool(tasks.send_email, description="E-mail the customer."),
        ])
        return {t.name: t for t in box}
    if variant == "naive":
        from . import naive

        return {"lookup_order": read, **{name: NaiveTool(name, getattr(naive, name))
                                         for name in ("charge_card", "create_shipment",
                                                      "send_email")}}
    raise ValueError(f"variant must be 'naive' or 'idempotent', got {variant!r}")


def mcp_tools() -> Toolbox:
    """The idempotent variant's tools as one Toolbox, for the MCP server::

        celery -A example_app.celery_app idem mcp --toolbox example_app.agent:mcp_tools

    A charge, a shipment and an e-mail each add something (``destructive=False``) at a
    provider outside this system (``open_world``, the default).
    """
    from . import tasks

    return Toolbox([
        tool(lookup_order, kind="read"),
        tool(tasks.charge_card, description="Charge the customer's card for an order.",
             destructive=False, timeout=20),
        tool(tasks.create_shipment, description="Create the shipment of a paid order.",
             destructive=False, timeout=20),
        tool(tasks.send_email, description="E-mail the customer.", destructive=False,
             timeout=20),
    ])


# --------------------------------------------------------------------------------------------
# the "model"
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    content: str


class ScriptedModel:
    """A deterministic stand-in for an LLM that fulfils "charge, ship and confirm order X".

    Plan: ``lookup_order`` -> ``charge_card`` -> ``create_shipment`` -> ``send_email`` -> reply.
    Like a real model, when a tool answers ``in_progress``, or an error it may retry, it calls
    the same tool again with the same arguments (up to ``max_calls`` times per tool), and then
    gives up. ``ok`` and ``duplicate`` are both successes.
    """

    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = max_calls

    def next_step(self, messages: list[Message], tools: dict[str, Any]) -> ToolCall | Reply:
        calls = [m["tool_call"] for m in messages if m["role"] == "assistant" and "tool_call" in m]
        results = {m["tool_call_id"]: m["content"]["result"] for m in messages
                   if m["role"] == "tool" and m["content"]["status"] in ("ok", "duplicate")}
        last = messages[-1]
        if last["role"] == "tool" and last["content"]["status"] in ("in_progress", "error"):
            failed, outcome = calls[-1], last["content"]
            again = outcome["status"] == "in_progress" or outcome.get("retryable", False)
            if again and sum(c["name"] == failed["name"] for c in calls) < self.max_calls:
                return ToolCall(failed["name"], dict(failed["arguments"]))
            return Reply(f"Sorry, {failed['name']} failed: {outcome['message']}")
        done = {c["name"]: results[c["id"]] for c in calls if c["id"] in results}
        order_id = messages[0]["order_id"]
        if "lookup_order" not in done:
            return ToolCall("lookup_order", {"order_id": order_id})
        order = done["lookup_order"]
        if "charge_card" not in done:
            return ToolCall("charge_card", {"order_id": order_id, "amount_cents": order["amount_cents"],
                                            "currency": order["currency"]})
        if "create_shipment" not in done:
            return ToolCall("create_shipment", {"order_id": order_id, "address": order["address"]})
        if "send_email" not in done:
            return ToolCall("send_email", {"to": order["email"], "template": "order_confirmed",
                                           "order_id": order_id})
        return Reply(f"Order {order_id} is paid ({done['charge_card'].get('id')}), shipped "
                     f"({done['create_shipment'].get('id')}) and {order['email']} was told.")


# --------------------------------------------------------------------------------------------
# the runtime
# --------------------------------------------------------------------------------------------


class Agent:
    """Runs one conversation: asks the model for a step, runs the tool, saves a checkpoint.

    Args:
        tools: The tools by name (see :func:`toolbox`): anything with ``start(arguments)``
            returning a pending call with ``task_id``, ``idempotency_key``,
            ``answered_at_enqueue`` and ``wait(timeout)`` (a :class:`celery_idem.contrib.tools.Tool`).
        model: Anything with ``next_step(messages, tools)``.
        checkpoint: JSON file the conversation is saved to after every step (None: no saving).
        timeouts: Seconds to wait for the first call of a write tool (default
            ``default_timeout``); when the wait runs out the model is told the call is
            ``in_progress`` (idempotent tools) or failed (naive tools). A call the model repeats
            waits ``default_timeout``.
        crash_after_enqueue: Tool name: SIGKILL this process right after enqueueing it
            (to show a crash and a resume from the checkpoint).
    """

    def __init__(self, tools: dict[str, Any], model: Any, checkpoint: Path | None = None,
                 timeouts: dict[str, float] | None = None, default_timeout: float = 20.0,
                 crash_after_enqueue: str | None = None,
                 on_step: Callable[[Message], None] | None = None) -> None:
        self.tools = tools
        self.model = model
        self.checkpoint = checkpoint
        self.timeouts = dict(timeouts or {})
        self.default_timeout = default_timeout
        self.crash_after_enqueue = crash_after_enqueue
        self.on_step = on_step or (lambda message: None)
        self.state: dict[str, Any] = {"messages": [], "events": [], "enqueued": []}

    def run(self, order_id: str) -> dict[str, Any]:
        """Work on "charge, ship and confirm ``order_id``" until the model replies.

        Returns:
            The final state: ``messages`` (the conversation) and ``events`` (what the runtime
            did besides the plan: re-calls, resumes).
        """
        if self.checkpoint is not None and self.checkpoint.exists():
            self.state = json.loads(self.checkpoint.read_text())
            self.state["events"].append("resumed from checkpoint")
        else:
            self._add({"role": "user", "order_id": order_id,
                       "content": f"Please charge, ship and confirm order {order_id}."})
        messages = self.state["messages"]
        while True:
            last = messages[-1]
            if last["role"] == "assistant" and "tool_call" in last:
                # A call without a result: the previous process died after issuing it.
                call = last["tool_call"]
                self.state["events"].append(f"re-issued {call['name']}")
            else:
                step = self.model.next_step(messages, self.tools)
                if isinstance(step, Reply):
                    self._add({"role": "assistant", "content": step.content})
                    return self.state
                call = {"id": f"call_{len(messages)}", "name": step.name,
                        "arguments": step.arguments}
                if any(m.get("tool_call", {}).get("name") == step.name for m in messages):
                    self.state["events"].append(f"re-called {step.name}")
                self._add({"role": "assistant", "tool_call": call})
            self._add(self._call(call))

    def _call(self, call: dict[str, Any]) -> Message:
        tool_ = self.tools[call["name"]]
        reply: Message = {"role": "tool", "tool_call_id": call["id"], "name": tool_.name}
        # start() checks the arguments and enqueues (a read tool runs here); the task id and
        # the key are saved before the wait, so a resumed process knows what it had started.
        pending = tool_.start(call["arguments"])
        if pending.task_id:
            reply["task_id"] = pending.task_id
            self.state.setdefault("enqueued", []).append({"tool": tool_.name,
                                                          "task_id": pending.task_id})
        if pending.idempotency_key:
            reply["idempotency_key"] = pending.idempotency_key
        if pending.answered_at_enqueue:
            # IdempotentTask found the action already done: nothing was sent to the broker.
            reply["answered_at_enqueue"] = True
        if self.crash_after_enqueue == tool_.name:
            self.state["events"].append(f"crashed after enqueueing {tool_.name}")
            self._save()
            os.kill(os.getpid(), signal.SIGKILL)
        first = sum(m.get("tool_call", {}).get("name") == tool_.name
                    for m in self.state["messages"]) == 1
        timeout = self.timeouts.get(tool_.name, self.default_timeout) if first else self.default_timeout
        reply["content"] = pending.wait(timeout)
        return reply

    def _add(self, message: Message) -> None:
        self.state["messages"].append(message)
        self._save()
        self.on_step(message)

    def _save(self) -> None:
        if self.checkpoint is None:
            return
        tmp = self.checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.checkpoint)


def _result_within(result: Any, deadline: float) -> Any:
    """``result.get()``, but only if the result was in hand by ``deadline`` (``time.monotonic()``).

    Only a poll that returned by the deadline counts: a result first seen after it is late, as
    for a runtime whose wait has run out, even if this process was merely too busy to look
    sooner. (Celery's Redis backend waits in steps of 1 s whatever ``get(timeout=)`` says, so
    the deadline is kept here.)
    """
    while True:
        ready = result.ready()
        now = time.monotonic()
        if now > deadline:
            raise ResultTimeout("no result by the deadline")
        if ready:
            return result.get(timeout=10, interval=0.05)
        time.sleep(min(0.05, deadline - now))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m example_app.agent")
    p.add_argument("--order", required=True)
    p.add_argument("--variant", choices=("naive", "idempotent"), default="idempotent")
    p.add_argument("--checkpoint", type=Path, help="resume from / save to this JSON file")
    p.add_argument("--crash-after-enqueue", metavar="TOOL",
                   help="SIGKILL this process right after enqueueing TOOL")
    args = p.parse_args(argv)
    agent = Agent(toolbox(args.variant), ScriptedModel(), checkpoint=args.checkpoint,
                  crash_after_enqueue=args.crash_after_enqueue)
    state = agent.run(args.order)
    print(state["messages"][-1]["content"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
