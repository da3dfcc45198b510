"""The tool: :class:`Tool` checks a model's arguments and starts the call, :class:`Pending` waits.

A write tool's task is enqueued through ``IdempotentTask.apply_async`` (gated, so a repeated
call is the same action); a read function runs here. Every outcome is the dict of
:mod:`~celery_idem.contrib.tools.outcome`, never an exception.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

from celery import Task
from celery.result import AsyncResult
from celery.states import FAILURE, READY_STATES, REVOKED, SUCCESS

from ...app import get_store
from ...exceptions import IdempotencyKeyMismatch, StoreUnavailable, TerminalError
from ...keys import canonical
from ...task import IdempotentTask
from . import formats
from .outcome import ToolKind, short
from .validation import validate

__all__ = ["Pending", "Tool"]

# The name users configure logging by (the module was celery_idem.tools).
logger = logging.getLogger("celery_idem.tools")


class Tool:
    """An agent tool: callable with keyword arguments, described in JSON Schema.

    Made by :func:`tool`. Calling it never raises for the model's mistakes or the task's
    errors: it returns the outcome dict described in this module's docstring.

    Attributes:
        name: The name the model calls.
        kind: ``"read"`` or ``"write"``.
        description: What the model is told.
        parameters: The JSON Schema of the arguments.
        timeout: Seconds a call waits for a task's result before answering ``in_progress``.
        target: The task or function.
        destructive: May overwrite or delete (MCP's ``destructiveHint``, write tools).
        open_world: Reaches beyond this system (MCP's ``openWorldHint``).
        key_argument: The argument used verbatim as the key, or None (derived key).
        title: A human-readable title, or None.
    """

    def __init__(self, target: Any, *, kind: ToolKind, name: str, description: str,
                 parameters: dict[str, Any], timeout: float, options: dict[str, Any],
                 destructive: bool = True, open_world: bool = True,
                 key_argument: str | None = None, key_passed_on: bool = True,
                 title: str | None = None) -> None:
        self.target = target
        self.kind: ToolKind = kind
        self.name = name
        self.description = description
        self.parameters = parameters
        self.timeout = timeout
        self.options = options
        self.destructive = destructive
        self.open_world = open_world
        self.key_argument = key_argument
        self._key_passed_on = key_passed_on
        self.title = title

    def __repr__(self) -> str:
        return f"<Tool {self.name} ({self.kind})>"

    # -- calling ---------------------------------------------------------------------------

    def __call__(self, **arguments: Any) -> dict[str, Any]:
        """Call the tool with keyword arguments and wait up to :attr:`timeout` seconds."""
        return self.invoke(arguments)

    def invoke(self, arguments: str | Mapping[str, Any] | None,
               timeout: float | None = None) -> dict[str, Any]:
        """Call the tool with a model's arguments (a JSON object text, or a dict).

        Args:
            arguments: The model's arguments: a JSON text (OpenAI's ``arguments``) or a
                mapping (Anthropic's ``input``); None for no arguments.
            timeout: Seconds to wait for the result (default :attr:`timeout`).

        Returns:
            The outcome dict (``status``, ``result``, ``message``, ...).
        """
        return self.start(arguments).wait(timeout)

    async def acall(self, **arguments: Any) -> dict[str, Any]:
        """Async :meth:`__call__`: enqueue and wait without blocking the event loop."""
        return await self.ainvoke(arguments)

    async def ainvoke(self, arguments: str | Mapping[str, Any] | None,
                      timeout: float | None = None) -> dict[str, Any]:
        """Async :meth:`invoke`: the enqueue and every poll of the result run in a thread.

        Cancelling the awaiting coroutine stops only the wait: the task goes on running and
        its key stays claimed, so a later call with the same arguments gets its result.

        Args:
            arguments: The model's arguments (JSON text or a mapping; None for none).
            timeout: Seconds to wait for the result (default :attr:`timeout`).

        Returns:
            The outcome dict, as :meth:`invoke` returns it.
        """
        # The enqueue talks to the store and the broker (blocking sockets): off the loop. A
        # cancellation while it runs leaves the thread to finish the publish.
        pending = await asyncio.to_thread(self.start, arguments)
        return await pending.wait_async(timeout)

    def start(self, arguments: str | Mapping[str, Any] | None) -> Pending:
        """Check the arguments and start the call, without waiting for its result.

        A write tool's task is enqueued (or answered from the store at once, when the action
        is already done); a read function runs to its end here. Save
        :attr:`Pending.task_id` and :attr:`Pending.idempotency_key` (to a checkpoint, say)
        before calling :meth:`Pending.wait`.
        """
        parsed, problems = self._parse(arguments)
        if problems:
            # Nothing was enqueued: the model can fix the call and try again.
            return Pending(self, outcome=self._error(
                "InvalidArguments", f"{self.name}: {'; '.join(problems)}. Nothing was done; "
                f"call it again with corrected arguments.", retryable=True))
        if not isinstance(self.target, Task):
            return Pending(self, outcome=self._run_here(parsed))
        key = self._own_key(parsed)
        options = dict(self.options, idempotency_key=key) if key is not None else dict(self.options)
        try:
            if key is None and isinstance(self.target, IdempotentTask):
                key = self.target.idempotency_key_for(kwargs=parsed)
            result = self.target.apply_async(kwargs=parsed, **options)
        except IdempotencyKeyMismatch as exc:
            return Pending(self, outcome=self._mismatch(exc, key))
        except (TypeError, ValueError) as exc:
            return Pending(self, outcome=self._error(
                "InvalidArguments", f"{self.name}: {short(exc)}. Nothing was done; call it "
                f"again with corrected arguments.", retryable=True, key=key))
        except Exception as exc:  # broker down, ...: nothing (or nothing known) was sent
            logger.warning("celery_idem.tools %s: enqueue failed: %s", self.name, exc,
                           exc_info=True)
            return Pending(self, outcome=self._error(
                type(exc).__name__, f"{self.name} could not be started: {short(exc)}. Calling "
                f"it again with the same arguments is safe.", retryable=True, key=key))
        key = getattr(result, "idempotency_key", None) or key
        return Pending(self, result=result, key=key)

    def _own_key(self, parsed: dict[str, Any]) -> str | None:
        """The caller's own key from :attr:`key_argument` (taken out of ``parsed`` when the
        task has no such parameter), or None for the key derived from the arguments."""
        if self.key_argument is None:
            return None
        value = parsed.get(self.key_argument)
        if not self._key_passed_on:
            parsed.pop(self.key_argument, None)
        # The caller's own key, verbatim (the task's apply_async checks its length).
        return None if value is None else str(value)

    def _parse(self, arguments: str | Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, (str, bytes)):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return {}, [f"the arguments are not valid JSON ({exc})"]
        if not isinstance(arguments, Mapping):
            return {}, [f"the arguments must be a JSON object, got {type(arguments).__name__}"]
        parsed = {n: v for n, v in arguments.items() if v is not None or not self._null_is_default(n)}
        return parsed, validate(self.parameters, parsed)

    def _null_is_default(self, name: str) -> bool:
        """Whether a null for ``name`` means "not given": OpenAI's strict mode sends null for
        an optional argument (see ``openai(strict=True)``); when the argument cannot be null,
        its default applies."""
        prop = self.parameters.get("properties", {}).get(name)
        if not isinstance(prop, Mapping) or "default" not in prop:
            return False
        return bool(validate({k: v for k, v in prop.items() if k != "default"}, None))

    def _run_here(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            value = self.target(**arguments)
        except Exception as exc:
            logger.info("celery_idem.tools %s failed: %s", self.name, exc, exc_info=True)
            return self._error(type(exc).__name__, f"{self.name} failed: {short(exc)}",
                               retryable=True)
        return self._success("ok", value, None, None)

    # -- outcomes --------------------------------------------------------------------------

    def _outcome(self, status: str, result: Any, message: str, key: str | None,
                 task_id: str | None) -> dict[str, Any]:
        return {"status": status, "result": result, "message": message, "tool": self.name,
                "idempotency_key": key, "task_id": task_id}

    def _success(self, status: str, value: Any, key: str | None, task_id: str | None,
                 original: str | None = None) -> dict[str, Any]:
        try:
            value = json.loads(json.dumps(value, default=canonical))
        except (TypeError, ValueError):
            return self._error("UnserializableResult", f"{self.name} finished, but its result "
                               f"({type(value).__name__}) cannot be shown as JSON.",
                               retryable=False, key=key, task_id=task_id)
        if status == "duplicate":
            message = (f"{self.name} had already been done with these arguments (task "
                       f"{original}); this is its recorded result. It was not done again.")
        else:
            message = f"{self.name} succeeded."
        return self._outcome(status, value, message, key, task_id)

    def _error(self, error: str, message: str, *, retryable: bool, key: str | None = None,
               task_id: str | None = None) -> dict[str, Any]:
        return {**self._outcome("error", None, message, key, task_id), "error": error,
                "retryable": retryable}

    def _mismatch(self, exc: BaseException, key: str | None, task_id: str | None = None
                  ) -> dict[str, Any]:
        return self._error(
            "IdempotencyKeyMismatch",
            f"{self.name} was already called for this action with different arguments, and "
            f"the first call stands ({short(exc)}). To do a different action, change the "
            f"arguments that identify it.", retryable=False, key=key, task_id=task_id)

    def _failure(self, exc: BaseException, key: str | None, task_id: str | None) -> dict[str, Any]:
        if isinstance(exc, IdempotencyKeyMismatch):
            return self._mismatch(exc, key, task_id)
        terminal: tuple[type[BaseException], ...] = (TerminalError,)
        if isinstance(self.target, IdempotentTask):
            terminal += self.target.idempotency_config.terminal_on
        text = f"{type(exc).__name__}: {short(exc)}"
        if isinstance(exc, terminal):
            return self._error(
                type(exc).__name__, f"{self.name} failed for good: {text}. Calling it again with "
                f"the same arguments returns the same error; change the arguments or tell the "
                f"user.", retryable=False, key=key, task_id=task_id)
        again = ("it will not run twice at the same time" if self.kind == "write"
                 else "it has no effect")
        return self._error(
            type(exc).__name__, f"{self.name} failed: {text}. The error is not marked "
            f"permanent: calling it again with the same arguments is allowed ({again}).",
            retryable=True, key=key, task_id=task_id)

    def _in_progress(self, waited: float, key: str | None, task_id: str | None) -> dict[str, Any]:
        if self.kind == "write":
            message = (f"{self.name} is still in progress after {waited:g} s. It is safe to call "
                       f"it again with the same arguments: the action will not be done twice, "
                       f"and the call returns its result once it is ready.")
        else:
            message = (f"{self.name} gave no result within {waited:g} s; it has no effect, so "
                       f"calling it again is safe.")
        return self._outcome("in_progress", None, message, key, task_id)

    # -- vendor formats --------------------------------------------------------------------

    def openai(self, api: Literal["chat", "responses"] = "chat", *,
               strict: bool = False) -> dict[str, Any]:
        """The tool in OpenAI's format.

        Args:
            api: ``"chat"`` (Chat Completions: ``{"type": "function", "function": {...}}``)
                or ``"responses"`` (Responses API: the same fields, not nested, and
                ``strict`` always present, as that API requires).
            strict: Add ``"strict": true`` and the schema OpenAI's strict mode needs: every
                property required (an optional one becomes nullable: a null argument means
                "use the default"), no ``default``, ``additionalProperties: false`` on every
                object.

        Raises:
            ToolError: ``strict`` and a parameter strict mode cannot describe (a free-form
                ``dict`` or an untyped value): the message names it.
        """
        return formats.openai_spec(self, api, strict=strict)

    def anthropic(self) -> dict[str, Any]:
        """The tool in Anthropic's Messages API format: ``name``, ``description``, ``input_schema``."""
        return formats.anthropic_spec(self)

    def annotations(self) -> dict[str, Any]:
        """MCP tool annotations (hints for the client).

        A write tool (an ``IdempotentTask``) is ``idempotentHint: true``: a repeated call
        with the same arguments has no further effect. A read tool is ``readOnlyHint: true``.
        ``destructiveHint`` and ``openWorldHint`` come from :func:`tool`'s ``destructive``
        and ``open_world``.
        """
        return formats.mcp_annotations(self)

    def mcp(self) -> dict[str, Any]:
        """The tool as an MCP ``Tool`` (JSON, as ``tools/list`` sends it).

        ``outputSchema`` is :data:`OUTCOME_SCHEMA`: a call's ``structuredContent`` is its
        outcome dict.
        """
        return formats.mcp_spec(self)

    def langchain(self) -> Any:
        """The tool as a LangChain ``StructuredTool`` (needs ``langchain-core``).

        The LangChain tool returns the same outcome dict.

        Raises:
            ImportError: ``langchain-core`` is not installed (the message says what to install).
        """
        return formats.langchain_tool(self)

    def pydantic_ai(self) -> Any:
        """The tool as a pydantic-ai ``Tool`` (needs ``pydantic-ai-slim``).

        Built with ``Tool.from_schema`` from this tool's JSON Schema; it awaits
        :meth:`ainvoke`, so an agent's run never blocks its event loop, and returns the same
        outcome dict.

        Raises:
            ImportError: pydantic-ai is not installed (the message says what to install).
        """
        return formats.pydantic_ai_tool(self)


class Pending:
    """A started tool call: enqueued (or already answered), not yet awaited.

    Attributes:
        tool: The tool.
        task_id: The Celery task id (None for a call answered without a task).
        idempotency_key: The action's key (write tools).
        answered_at_enqueue: True when the action was already done and nothing was enqueued.
    """

    def __init__(self, tool: Tool, *, result: AsyncResult | None = None,
                 key: str | None = None, outcome: dict[str, Any] | None = None) -> None:
        self.tool = tool
        self.result = result
        self.idempotency_key = key
        self.task_id: str | None = result.id if result is not None else None
        self.answered_at_enqueue = getattr(result, "original_task_id", None) is not None
        self.outcome = outcome

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds (default the tool's) and return the outcome dict.

        Never raises: a result not there in time gives ``in_progress``.
        """
        if self.outcome is not None:
            return self.outcome
        assert self.result is not None
        timeout = self.tool.timeout if timeout is None else timeout
        result, tool, key = self.result, self.tool, self.idempotency_key
        try:
            # Polling reads the state from the backend too: inside the try, so a backend that
            # is down gives an error outcome, not an exception.
            if not _ready_within(result, timeout):
                return tool._in_progress(timeout, key, self.task_id)
            state, value = result.state, result.result
        except Exception as exc:  # the result backend is down, or the result unreadable
            logger.warning("celery_idem.tools %s: result of %s unreadable: %s", tool.name,
                           self.task_id, exc, exc_info=True)
            return tool._error(type(exc).__name__, f"{tool.name}: its result could not be read "
                               f"({short(exc)}); calling it again with the same arguments is "
                               f"safe.", retryable=True, key=key, task_id=self.task_id)
        self.outcome = self._finished(state, value)
        return self.outcome

    def _finished(self, state: str, value: Any) -> dict[str, Any]:
        """The outcome of a task that is done: its ``state`` and ``value`` (result or error)."""
        tool, key = self.tool, self.idempotency_key
        if state == SUCCESS:
            if self.answered_at_enqueue:  # a CachedResult: its id is the original task's
                status, original = "duplicate", self.task_id
            else:
                original = self._original_task_id()
                status = "duplicate" if original and original != self.task_id else "ok"
            return tool._success(status, value, key, self.task_id, original)
        if state == FAILURE and isinstance(value, BaseException):
            return tool._failure(value, key, self.task_id)
        if state == REVOKED:
            return tool._error("Revoked", f"{tool.name} was cancelled (revoked) before it "
                               f"finished.", retryable=True, key=key, task_id=self.task_id)
        return tool._error(str(state), f"{tool.name} ended in state {state}.",
                           retryable=True, key=key, task_id=self.task_id)

    async def wait_async(self, timeout: float | None = None) -> dict[str, Any]:
        """Async :meth:`wait`: polls the result in a thread and sleeps on the event loop.

        Cancelling the coroutine stops the wait only; the task is not revoked.
        """
        if self.outcome is not None:
            return self.outcome
        assert self.result is not None
        timeout = self.tool.timeout if timeout is None else timeout
        result = self.result
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        interval = 0.02
        while True:
            try:
                ready = await asyncio.to_thread(lambda: result.state in READY_STATES)
            except Exception:
                ready = True  # wait() reads it again and turns the failure into an outcome
            remaining = deadline - loop.time()
            if ready or remaining <= 0:
                break
            await asyncio.sleep(min(interval, remaining))
            interval = min(interval * 2, 0.25)
        if not ready:
            return self.tool._in_progress(timeout, self.idempotency_key, self.task_id)
        # Ready: wait(0) reads the state and value and builds the outcome (the store read that
        # tells a duplicate apart is a blocking call too).
        return await asyncio.to_thread(self.wait, 0.0)

    def _original_task_id(self) -> str | None:
        """The task id whose body ran for this key (a worker-side duplicate answers with it)."""
        target = self.tool.target
        if self.idempotency_key is None or not isinstance(target, IdempotentTask):
            return None
        try:
            record = get_store(target.app).get(self.idempotency_key)
        except StoreUnavailable:
            return None  # the result itself is right; only the label "duplicate" is unknown
        return record.task_id if record is not None else None


def _ready_within(result: AsyncResult, timeout: float) -> bool:
    """Poll ``result.ready()`` until ``timeout`` (Celery's own ``get(timeout=)`` waits in whole
    seconds on the Redis backend, and raises instead of answering)."""
    deadline = time.monotonic() + timeout
    interval = 0.02
    while True:
        if result.state in READY_STATES:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval, remaining))
        interval = min(interval * 2, 0.25)

