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
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from celery import Task
from celery.result import AsyncResult
from celery.states import FAILURE, READY_STATES, REVOKED, SUCCESS

from ...app import get_store
from ...events import escape_args
from ...exceptions import IdempotencyKeyMismatch, InvalidKey, StoreUnavailable, TerminalError
from ...identity import PRINCIPAL_HEADER
from ...keys import canonical, check_scope, check_text
from ...task import IdempotentTask
from . import action, formats
from .outcome import MAX_ARGUMENT_DEPTH, MAX_ARGUMENTS_SIZE, ToolKind, short
from .validation import check_bounds, integral, validate

__all__ = ["Pending", "Tool"]

# A child of the library's "celery_idem" logger, so configuring that one covers it.
logger = logging.getLogger("celery_idem.tools")
logger.addFilter(escape_args)

#: An exception class with this attribute set to True may be shown to the model (its type and
#: its text), as a ``TerminalError`` is; see :func:`~celery_idem.contrib.tools.tool`'s
#: ``expose_errors``.
EXPOSE_ATTRIBUTE = "expose_to_model"


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
        key_argument: The argument whose value is the call's own key, or None (derived key).
        title: A human-readable title, or None.
        expose_errors: Exception types whose text the model may see (besides
            ``TerminalError`` and classes with ``expose_to_model = True``).
    """

    def __init__(self, target: Any, *, kind: ToolKind, name: str, description: str,
                 parameters: dict[str, Any], timeout: float, options: dict[str, Any],
                 destructive: bool = True, open_world: bool = True,
                 key_argument: str | None = None, key_passed_on: bool = True, title: str | None = None,
                 expose_errors: tuple[type[BaseException], ...] = ()) -> None:
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
        self.expose_errors = expose_errors

    def __repr__(self) -> str:
        return f"<Tool {self.name} ({self.kind})>"

    # -- calling ---------------------------------------------------------------------------

    def __call__(self, **arguments: Any) -> dict[str, Any]:
        """Call the tool with keyword arguments and wait up to :attr:`timeout` seconds."""
        return self.invoke(arguments)

    def invoke(self, arguments: str | Mapping[str, Any] | None, timeout: float | None = None, *,
               scope: str | None = None, principal: str | None = None) -> dict[str, Any]:
        """Call the tool with a model's arguments (a JSON object text, or a dict).

        Args:
            arguments: The model's arguments: a JSON text (OpenAI's ``arguments``) or a
                mapping (Anthropic's ``input``); None for no arguments.
            timeout: Seconds to wait for the result (default :attr:`timeout`).
            scope: The caller's scope (a tenant): two scopes are two actions (see :meth:`start`).
            principal: Who is calling, for the body (see :meth:`start`).

        Returns:
            The outcome dict (``status``, ``result``, ``message``, ...).

        Raises:
            InvalidKey: ``scope`` or ``principal`` is not valid (the caller's mistake).
        """
        return self.start(arguments, scope=scope, principal=principal).wait(timeout)

    async def acall(self, **arguments: Any) -> dict[str, Any]:
        """Async :meth:`__call__`: enqueue and wait without blocking the event loop."""
        return await self.ainvoke(arguments)

    async def ainvoke(self, arguments: str | Mapping[str, Any] | None,
                      timeout: float | None = None, *, scope: str | None = None,
                      principal: str | None = None) -> dict[str, Any]:
        """Async :meth:`invoke` (same arguments, outcome and errors): the enqueue and every
        poll of the result run in a thread.

        Cancelling the awaiting coroutine stops only the wait: the task goes on running and
        its key stays claimed, so a later call with the same arguments gets its result.
        """
        # The enqueue talks to the store and the broker (blocking sockets): off the loop. A
        # cancellation while it runs leaves the thread to finish the publish.
        pending = await asyncio.to_thread(self.start, arguments, scope=scope, principal=principal)
        return await pending.wait_async(timeout)

    def start(self, arguments: str | Mapping[str, Any] | None, *,
              scope: str | None = None, principal: str | None = None) -> Pending:
        """Check the arguments and start the call, without waiting for its result.

        A write tool's task is enqueued (or answered from the store at once, when the action
        is already done); a read function runs to its end here. Save
        :attr:`Pending.task_id` and :attr:`Pending.idempotency_key` (to a checkpoint, say)
        before calling :meth:`Pending.wait`.

        Args:
            arguments: The model's arguments (JSON text or a mapping; None for none). At most
                :data:`~celery_idem.contrib.tools.MAX_ARGUMENT_DEPTH` levels deep and
                :data:`~celery_idem.contrib.tools.MAX_ARGUMENTS_SIZE` characters; anything that
                does not parse within them is an ``InvalidArguments`` outcome.
            scope: The caller's scope (a tenant, a principal), passed to the task as
                ``apply_async(..., idempotency_scope=scope)``: the action's key is in that
                scope, so the same arguments (or the same ``key_argument``) in two scopes are
                two actions, and one scope never reads another's result. A read tool has no
                key and ignores it.
            principal: Who is calling, sent in the ``idempotency_principal`` header: the body
                reads it as ``self.idempotency_principal``; the tasks it enqueues carry it on.

        Raises:
            InvalidKey: ``scope`` is not a valid scope (1 to 64 characters of ``A-Z a-z 0-9 . _ ~
                + = / -``), or ``principal`` not printable text of at most 200 characters.
        """
        if scope is not None:
            check_scope(scope)
        if principal is not None:
            check_text("principal", principal)
        parsed, problems = self._parse(arguments)
        if problems:
            # Nothing was enqueued: the model can fix the call and try again.
            return Pending(self, outcome=self._invalid("; ".join(problems)))
        if not isinstance(self.target, Task):
            return Pending(self, outcome=self._run_here(parsed))
        gated = isinstance(self.target, IdempotentTask)
        own = self._own_key(parsed)
        options = dict(self.options)
        if own is not None:
            options["idempotency_key"] = own
        if gated and scope is not None:
            options["idempotency_scope"] = scope
        if principal is not None:
            options["headers"] = {**(options.get("headers") or {}), PRINCIPAL_HEADER: principal}
        key: str | None = None
        try:
            if gated:
                key = self.target.idempotency_key_for(
                    kwargs=parsed, idempotency_key=own, idempotency_scope=scope)
            result = self.target.apply_async(kwargs=parsed, **options)
        except IdempotencyKeyMismatch as exc:
            return Pending(self, outcome=self._mismatch(exc, key, per_call=own is not None))
        except InvalidKey as exc:
            # The model's key (its key_argument): one it can fix. A bad scope was refused above.
            where = f"argument {self.key_argument!r}: " if own is not None else ""
            return Pending(self, outcome=self._invalid(f"{where}{short(exc)}", key))
        except Exception as exc:  # broker down, a key_func's TypeError, ...: nothing was sent
            # The text can hold a broker URL or a DSN with its password: the log has it, the
            # model only the type and the error id. Only the model's own mistakes are shown.
            error_id = self._log_failure("could not be started", exc, key, None)
            return Pending(self, outcome=self._error(
                type(exc).__name__, f"{self.name} could not be started ({type(exc).__name__}; "
                f"error id {error_id}). Calling it again with the same arguments is safe.",
                retryable=not isinstance(exc, (TypeError, ValueError)), key=key,
                error_id=error_id))
        key = getattr(result, "idempotency_key", None) or key
        pending = Pending(self, result=result, key=key, per_call=own is not None, arguments=parsed)
        if gated and not (pending.attached or pending.answered_at_enqueue):
            action.remember(self, pending.task_id, parsed)  # this call starts the action
        return pending

    def _own_key(self, parsed: dict[str, Any]) -> Any:
        """The caller's own key from :attr:`key_argument` (taken out of ``parsed`` when the
        task has no such parameter), or None for the key derived from the arguments."""
        if self.key_argument is None:
            return None
        value = parsed.get(self.key_argument)
        if not self._key_passed_on:
            parsed.pop(self.key_argument, None)
        # Passed on as given: the task's key check refuses a non-str, an empty or long one, or
        # one with control characters (InvalidKey), which is answered as invalid arguments.
        return value

    def _parse(self, arguments: str | bytes | Mapping[str, Any] | None
               ) -> tuple[dict[str, Any], list[str]]:
        """The arguments as a dict, and their problems (each one sentence); never raises."""
        try:
            return self._parse_bounded(arguments)
        except Exception as exc:  # a RecursionError or any other surprise of a validator
            # An outcome, never an exception, whatever a hostile input makes the parser or the
            # schema check do. No traceback: a recursion's is a thousand frames, per call.
            logger.info("celery_idem.tools %s: arguments refused: %s: %r", self.name,
                        type(exc).__name__, str(exc)[:200])
            return {}, [f"the arguments could not be read ({type(exc).__name__})"]

    def _parse_bounded(self, arguments: str | bytes | Mapping[str, Any] | None
                       ) -> tuple[dict[str, Any], list[str]]:
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, (str, bytes, bytearray)):
            # Sized before parsing: the parser's work (and memory) is bounded by it.
            if len(arguments) > MAX_ARGUMENTS_SIZE:
                return {}, [f"the arguments are larger than {MAX_ARGUMENTS_SIZE} characters"]
            try:
                arguments = json.loads(arguments)
            except RecursionError:  # nesting deeper than the interpreter's recursion limit
                return {}, [f"the arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels"]
            except ValueError as exc:
                return {}, [f"the arguments are not valid JSON ({short(exc)})"]
        if not isinstance(arguments, Mapping):
            return {}, [f"the arguments must be a JSON object, got {type(arguments).__name__}"]
        # Bounded before the schema check and the key's canonical form walk them (recursively).
        problem = check_bounds(arguments, MAX_ARGUMENT_DEPTH, MAX_ARGUMENTS_SIZE)
        if problem is not None:
            return {}, [f"the arguments are refused: {problem}"]
        parsed = {n: v for n, v in arguments.items() if v is not None or not self._null_is_default(n)}
        problems = validate(self.parameters, parsed)
        return (parsed if problems else integral(self.parameters, parsed)), problems

    def _null_is_default(self, name: str) -> bool:
        """Whether a null for ``name`` means "not given" (OpenAI's strict mode sends null for an
        optional argument): when the argument cannot be null, its default applies."""
        prop = self.parameters.get("properties", {}).get(name)
        if not isinstance(prop, Mapping) or "default" not in prop:
            return False
        return bool(validate({k: v for k, v in prop.items() if k != "default"}, None))

    def _run_here(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            value = self.target(**arguments)
        except Exception as exc:
            return self._failure(exc, None, None, exc_info=True)
        return self._success("ok", value, None, None)

    # -- outcomes --------------------------------------------------------------------------

    def _outcome(self, status: str, result: Any, message: str, key: str | None,
                 task_id: str | None) -> dict[str, Any]:
        return {"status": status, "result": result, "message": message, "tool": self.name,
                "idempotency_key": key, "task_id": task_id}

    def _success(self, status: str, value: Any, key: str | None, task_id: str | None,
                 original: str | None = None, arguments: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
        try:
            value = json.loads(json.dumps(value, default=canonical))
        except (TypeError, ValueError):
            return self._error("UnserializableResult", f"{self.name} finished, but its result "
                               f"({type(value).__name__}) cannot be shown as JSON.",
                               retryable=False, key=key, task_id=task_id)
        if status == "duplicate":
            message = action.duplicate_message(self, original, arguments or {})
        else:
            message = f"{self.name} succeeded."
        return self._outcome(status, value, message, key, task_id)

    def _error(self, error: str, message: str, *, retryable: bool, key: str | None = None,
               task_id: str | None = None, error_id: str | None = None) -> dict[str, Any]:
        outcome = {**self._outcome("error", None, message, key, task_id), "error": error,
                   "retryable": retryable}
        if error_id is not None:
            outcome["error_id"] = error_id
        return outcome

    def _invalid(self, problem: str, key: str | None = None) -> dict[str, Any]:
        """The outcome of arguments (or a key) that cannot be used: nothing was done."""
        return self._error(
            "InvalidArguments", f"{self.name}: {problem}. Nothing was done; call it again with "
            f"corrected arguments.", retryable=True, key=key)

    def _mismatch(self, exc: BaseException, key: str | None, task_id: str | None = None, *,
                  per_call: bool = False) -> dict[str, Any]:
        if per_call:
            # The model chose the key: the way out is a new key, not other arguments.
            message = (f"{self.name}: this key ({self.key_argument}) was already used for a "
                       f"different action (other arguments), and that first action stands; "
                       f"nothing was done now. Use a new key for a new action; repeat the first "
                       f"call's arguments with this key to get its result.")
        else:
            message = (f"{self.name} was already called for this action with different "
                       f"arguments, and the first call stands; nothing was done now. To do a "
                       f"different action, use a new key: change the arguments that identify it.")
        return self._error("IdempotencyKeyMismatch", message, retryable=False, key=key,
                           task_id=task_id)

    def _shown(self, exc: BaseException) -> bool:
        """Whether the model may see ``exc``'s text (else only its type and an error id)."""
        return (isinstance(exc, (TerminalError, *self.expose_errors))
                or getattr(type(exc), EXPOSE_ATTRIBUTE, False) is True)

    def _log_failure(self, what: str, exc: BaseException, key: str | None,
                     task_id: str | None, traceback: str | None = None,
                     exc_info: bool = False) -> str:
        """Log ``exc`` in full under a new error id, and return the id (the model gets it)."""
        error_id = uuid.uuid4().hex[:16]
        detail = f"\n{traceback.rstrip()}" if traceback else ""
        logger.warning("celery_idem.tools %s %s [error_id=%s task_id=%s key=%r]: %s: %r%s",
                       self.name, what, error_id, task_id, key, type(exc).__name__, str(exc),
                       detail, exc_info=exc if exc_info else None)
        return error_id

    def _failure(self, exc: BaseException, key: str | None, task_id: str | None, *,
                 traceback: str | None = None, per_call: bool = False,
                 exc_info: bool = False) -> dict[str, Any]:
        if isinstance(exc, IdempotencyKeyMismatch):
            return self._mismatch(exc, key, task_id, per_call=per_call)
        terminal: tuple[type[BaseException], ...] = (TerminalError,)
        if isinstance(self.target, IdempotentTask):
            terminal += self.target.idempotency_config.terminal_on
        kind = type(exc).__name__
        if self._shown(exc):
            text, error_id = f"{kind}: {short(exc)}", None
        else:
            # An exception's text can hold anything the body had (a DSN with its password,
            # another customer's data): the model gets the type and an id the log has it under.
            error_id = self._log_failure("failed", exc, key, task_id, traceback, exc_info)
            text = f"{kind} (the details are in the server's log under error id {error_id})"
        if isinstance(exc, terminal):
            return self._error(
                kind, f"{self.name} failed for good: {text}. Calling it again with the same "
                f"arguments returns the same error; change the arguments or tell the user.",
                retryable=False, key=key, task_id=task_id, error_id=error_id)
        again = ("it will not run twice at the same time" if self.kind == "write"
                 else "it has no effect")
        return self._error(
            kind, f"{self.name} failed: {text}. The error is not marked permanent: calling it "
            f"again with the same arguments is allowed ({again}).",
            retryable=True, key=key, task_id=task_id, error_id=error_id)

    def _in_progress(self, waited: float, key: str | None, task_id: str | None) -> dict[str, Any]:
        message = (f"{self.name} is still in progress after {waited:g} s. It is safe to call it "
                   f"again with the same arguments: the call waits on the same running action "
                   f"(nothing is sent again, the action will not be done twice), and returns its "
                   f"result once it is ready." if self.kind == "write" else f"{self.name} gave no "
                   f"result within {waited:g} s; it has no effect, so calling it again is safe.")
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

    def langchain(self, *, scope: str | None = None) -> Any:
        """The tool as a LangChain ``StructuredTool`` (needs ``langchain-core``).

        The LangChain tool returns the same outcome dict.

        Args:
            scope: The scope of every call the LangChain tool makes (see :meth:`start`).

        Raises:
            ImportError: ``langchain-core`` is not installed (the message says what to install).
            InvalidKey: ``scope`` is not a valid scope.
        """
        return formats.langchain_tool(self, None if scope is None else check_scope(scope))

    def pydantic_ai(self, *, scope: str | None = None) -> Any:
        """The tool as a pydantic-ai ``Tool`` (needs ``pydantic-ai-slim``).

        Built with ``Tool.from_schema`` from this tool's JSON Schema; it awaits
        :meth:`ainvoke`, so an agent's run never blocks its event loop, and returns the same
        outcome dict.

        Args:
            scope: The scope of every call the pydantic-ai tool makes (see :meth:`start`).

        Raises:
            ImportError: pydantic-ai is not installed (the message says what to install).
            InvalidKey: ``scope`` is not a valid scope.
        """
        return formats.pydantic_ai_tool(self, None if scope is None else check_scope(scope))


class Pending:
    """A started tool call: enqueued (or already answered), not yet awaited.

    Attributes:
        tool: The tool.
        task_id: The Celery task id (None for a call answered without a task).
        idempotency_key: The action's key (write tools).
        answered_at_enqueue: True when the action was already done and nothing was enqueued.
    """

    def __init__(self, tool: Tool, *, result: AsyncResult | None = None,
                 key: str | None = None, outcome: dict[str, Any] | None = None,
                 per_call: bool = False, arguments: Mapping[str, Any] | None = None) -> None:
        self.tool = tool
        self._arguments = arguments or {}
        self.result = result
        self.idempotency_key = key
        # Whether the key is the caller's own (key_argument): a mismatch then asks for a new key.
        self._per_call = per_call
        self.task_id: str | None = result.id if result is not None else None
        #: The enqueue attached to the action under way: nothing was sent, and
        #: ``task_id`` is the running attempt's.
        self.attached = bool(getattr(result, "attached", False))
        self.answered_at_enqueue = not self.attached and \
            getattr(result, "original_task_id", None) is not None
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
            error_id = tool._log_failure("result unreadable", exc, key, self.task_id,
                                         exc_info=True)
            return tool._error(type(exc).__name__, f"{tool.name}: its result could not be read "
                               f"({type(exc).__name__}; error id {error_id}); calling it again "
                               f"with the same arguments is safe.", retryable=True, key=key,
                               task_id=self.task_id, error_id=error_id)
        self.outcome = self._finished(state, value)
        return self.outcome

    def _finished(self, state: str, value: Any) -> dict[str, Any]:
        """The outcome of a task that is done: its ``state`` and ``value`` (result or error)."""
        tool, key = self.tool, self.idempotency_key
        if state == SUCCESS:
            if self.answered_at_enqueue or self.attached:
                # A CachedResult or an AttachedResult: its id is the original task's.
                status, original = "duplicate", self.task_id
            else:
                original = self._original_task_id()
                status = "duplicate" if original and original != self.task_id else "ok"
            return tool._success(status, value, key, self.task_id, original, self._arguments)
        if state == FAILURE and isinstance(value, BaseException):
            return tool._failure(value, key, self.task_id, per_call=self._per_call,
                                 traceback=self._traceback())
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

        async def ready() -> bool:
            try:
                return await asyncio.to_thread(lambda: result.state in READY_STATES)
            except Exception:
                return True  # wait() reads it again and turns the failure into an outcome

        loop = asyncio.get_running_loop()
        for pause in _pauses(loop.time() + timeout, loop.time):
            if await ready():
                break
            await asyncio.sleep(pause)
        else:
            if not await ready():
                return self.tool._in_progress(timeout, self.idempotency_key, self.task_id)
        # Ready: wait(0) reads the state and value and builds the outcome (the store read that
        # tells a duplicate apart is a blocking call too).
        return await asyncio.to_thread(self.wait, 0.0)

    def _traceback(self) -> str | None:
        """The worker's traceback of a failed task, for the log (never for the model)."""
        try:
            text = self.result.traceback if self.result is not None else None
        except Exception:  # the backend went away since: the log has the rest
            return None
        return text if isinstance(text, str) else None

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
    for pause in _pauses(time.monotonic() + timeout, time.monotonic):
        if result.state in READY_STATES:
            return True
        time.sleep(pause)
    return result.state in READY_STATES


def _pauses(deadline: float, clock: Callable[[], float]) -> Iterator[float]:
    """The pauses between two polls until ``deadline`` on ``clock``: 20 ms, doubling to 250 ms."""
    interval = 0.02
    while (remaining := deadline - clock()) > 0:
        yield min(interval, remaining)
        interval = min(interval * 2, 0.25)

