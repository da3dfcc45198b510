"""A small tool-calling agent with a checkpoint, and a scripted "model" that drives it.

No model service is reachable here, so :class:`ScriptedModel` plays the LLM: given the
conversation so far and the tool list, it returns the next tool call or a final reply, as a
chat-completions client would. A real LLM client can replace it by implementing
:meth:`ScriptedModel.next_step` with the same arguments and return values.

Tools are tagged ``read`` (run in the agent process, safe to repeat: ``lookup_order``) or
``write`` (a Celery task: ``charge_card``, ``create_shipment``, ``send_email``). The write tools
come in two variants: ``idempotent`` (:mod:`example_app.tasks`) and ``naive``
(:mod:`example_app.naive`).

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

Message = dict[str, Any]


# --------------------------------------------------------------------------------------------
# tools
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One tool the model may call.

    Attributes:
        name: The name the model uses.
        kind: ``read`` (no effect, run in process) or ``write`` (an effect, run as a task).
        description: What the model is told about it.
        parameters: Argument names (a real client would send a JSON schema).
        run: For ``read``: a function of the arguments. For ``write``: a Celery task.
    """

    name: str
    kind: Literal["read", "write"]
    description: str
    parameters: tuple[str, ...]
    run: Any


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


def toolbox(variant: Literal["naive", "idempotent"]) -> dict[str, Tool]:
    """The tools, with the write tools of ``variant``."""
    if variant == "idempotent":
        from . import tasks as writes
    elif variant == "naive":
        from . import naive as writes  # type: ignore[no-redef]
    else:
        raise ValueError(f"variant must be 'naive' or 'idempotent', got {variant!r}")
    return {t.name: t for t in (
        Tool("lookup_order", "read", "Look up an order and its payments.", ("order_id",),
             lookup_order),
        Tool("charge_card", "write", "Charge the customer's card for an order.",
             ("order_id", "amount_cents", "currency"), writes.charge_card),
        Tool("create_shipment", "write", "Create the shipment of a paid order.",
             ("order_id", "address"), writes.create_shipment),
        Tool("send_email", "write", "E-mail the customer.", ("to", "template", "order_id"),
             writes.send_email),
    )}


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
    Like a real model, when a tool result looks like an error it calls the same tool again
    (up to ``max_calls`` times per tool), and then gives up.
    """

    def __init__(self, max_calls: int = 2) -> None:
        self.max_calls = max_calls

    def next_step(self, messages: list[Message], tools: dict[str, Tool]) -> ToolCall | Reply:
        calls = [m["tool_call"] for m in messages if m["role"] == "assistant" and "tool_call" in m]
        results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        last = messages[-1]
        if last["role"] == "tool" and isinstance(last["content"], dict) and "error" in last["content"]:
            failed = calls[-1]
            if sum(c["name"] == failed["name"] for c in calls) < self.max_calls:
                return ToolCall(failed["name"], dict(failed["arguments"]))
            return Reply(f"Sorry, {failed['name']} failed: {last['content']['error']}")
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
        tools: The tool registry (see :func:`toolbox`).
        model: Anything with ``next_step(messages, tools)``.
        checkpoint: JSON file the conversation is saved to after every step (None: no saving).
        timeouts: Seconds to wait for the first call of a write tool (default
            ``default_timeout``); when the wait runs out the model is told the tool failed.
            A call the model repeats waits ``default_timeout``.
        crash_after_enqueue: Tool name: SIGKILL this process right after enqueueing it
            (to show a crash and a resume from the checkpoint).
    """

    def __init__(self, tools: dict[str, Tool], model: Any, checkpoint: Path | None = None,
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
        tool = self.tools[call["name"]]
        args = call["arguments"]
        reply: Message = {"role": "tool", "tool_call_id": call["id"], "name": tool.name}
        if tool.kind == "read":
            return {**reply, "content": tool.run(**args)}
        result = tool.run.apply_async(kwargs=args)
        reply["task_id"] = result.id
        self.state.setdefault("enqueued", []).append({"tool": tool.name, "task_id": result.id})
        key = getattr(result, "idempotency_key", None) or _key_of(tool.run, args)
        if key:
            reply["idempotency_key"] = key
        if getattr(result, "original_task_id", None):
            # IdempotentTask found the action already done: nothing was sent to the broker.
            reply["answered_at_enqueue"] = True
        if self.crash_after_enqueue == tool.name:
            self.state["events"].append(f"crashed after enqueueing {tool.name}")
            self._save()
            os.kill(os.getpid(), signal.SIGKILL)
        first = sum(m.get("tool_call", {}).get("name") == tool.name
                    for m in self.state["messages"]) == 1
        timeout = self.timeouts.get(tool.name, self.default_timeout) if first else self.default_timeout
        try:
            reply["content"] = _result_within(result, timeout)
        except ResultTimeout:
            reply["content"] = {"error": f"{tool.name} gave no result within {timeout:g} s"}
        except Exception as exc:  # the model sees the error, like any tool error
            reply["content"] = {"error": f"{type(exc).__name__}: {exc}"}
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


def _result_within(result: Any, timeout: float) -> Any:
    """``result.get()``, but only if it is ready within ``timeout`` seconds.

    (Celery's Redis backend waits in steps of 1 s whatever ``get(timeout=)`` says, so the
    deadline is kept here.)
    """
    deadline = time.monotonic() + timeout
    while not result.ready():
        if time.monotonic() >= deadline:
            raise ResultTimeout(f"no result within {timeout:g} s")
        time.sleep(0.05)
    return result.get(timeout=10, interval=0.05)


def _key_of(task: Any, args: dict[str, Any]) -> str | None:
    key_for = getattr(task, "idempotency_key_for", None)
    return key_for(kwargs=args) if key_for else None


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
