"""An MCP server for a :class:`~celery_idem.contrib.tools.Toolbox`: the same tools, over MCP.

Needs the official MCP Python SDK (``pip install 'celery-idem[mcp]'``). From a shell::

    celery -A proj idem mcp --toolbox proj.agent:tools                      # stdio
    celery -A proj idem mcp --toolbox proj.agent:tools --http 127.0.0.1:8765  # streamable HTTP

Embedded in Python::

    from celery_idem.contrib.mcp import server   # or, as before: celery_idem.mcp

    mcp_server = server(tools)        # an mcp.server.lowlevel.Server
    app = mcp_server.streamable_http_app()   # or: await mcp_server.run(read, write, ...)

Each tool is listed with its input schema, :data:`~celery_idem.contrib.tools.OUTCOME_SCHEMA` as its
output schema, and annotations (:meth:`~celery_idem.contrib.tools.Tool.annotations`): write tools
``idempotentHint: true``, read tools ``readOnlyHint: true``. A call runs through
:meth:`~celery_idem.contrib.tools.Toolbox.acall`, so the server's event loop never blocks on a task,
and answers with the outcome dict as ``structuredContent`` plus a short text for clients that
show the model text only. ``isError`` is set for the ``error`` status only: a ``duplicate``
is a success, and ``in_progress`` tells the model that calling again is safe.

The key is derived from the call's arguments exactly as for the task; the JSON-RPC request
id, the session and any ``_meta`` the client sends are not part of it, so a client that
retries a call with a new request id gets the same action.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from .tools import MAX_MESSAGE, Toolbox

__all__ = ["INSTRUCTIONS", "load_toolbox", "serve", "serve_http", "serve_stdio", "server", "text_of"]

#: The server's name in the MCP handshake, unless :func:`server` is given another.
DEFAULT_NAME = "celery-idem"
#: What the client may tell the model about the tools as a whole, unless :func:`server` is
#: given other instructions.
INSTRUCTIONS = (
    "Write tools (idempotentHint) do each action once: calling one again with the same "
    "arguments returns the first call's result (status duplicate, a success). A status "
    "in_progress means the action is still running; calling again with the same arguments "
    "is safe and returns its result once it is ready."
)


def server(toolbox: Toolbox, *, name: str = DEFAULT_NAME,
           instructions: str | None = None) -> Server[Any]:
    """Make an MCP server that serves every tool of ``toolbox``.

    Args:
        toolbox: The tools.
        name: The server's name in the handshake.
        instructions: Text the client may give the model about the tools as a whole
            (default :data:`INSTRUCTIONS`).

    Returns:
        An ``mcp.server.lowlevel.Server``: run it on stdio (:func:`serve_stdio`), mount
        ``server.streamable_http_app()`` in an ASGI app, or pass it to ``mcp.Client`` in a
        test.
    """
    # Validated once, here: a tool the SDK's own model refuses fails at start-up, not per call.
    listed = [types.Tool.model_validate(spec) for spec in toolbox.mcp()]

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        # Only the tool's name and arguments go on: ctx.request_id and params.meta are the
        # client's per-request data and must not make a retried call a different action.
        outcome = await toolbox.acall(params.name, params.arguments or {})
        return types.CallToolResult(
            content=[types.TextContent(text=text_of(outcome))],
            structured_content=outcome,
            is_error=outcome.get("status") == "error",
        )

    return Server(name, instructions=INSTRUCTIONS if instructions is None else instructions,
                  on_list_tools=list_tools, on_call_tool=call_tool)


def text_of(outcome: dict[str, Any]) -> str:
    """The short text of an outcome, for a client that shows the model only text.

    The message, then the result as JSON (cut at :data:`~celery_idem.contrib.tools.MAX_MESSAGE`
    characters; the structured content has all of it).
    """
    text = str(outcome.get("message", ""))
    if outcome.get("result") is not None:
        shown = json.dumps(outcome["result"])
        if len(shown) > MAX_MESSAGE:
            shown = shown[: MAX_MESSAGE - 3] + "..."
        text = f"{text}\nResult: {shown}"
    return text


def load_toolbox(spec: str) -> Toolbox:
    """Import ``MODULE:NAME`` and return the :class:`~celery_idem.contrib.tools.Toolbox` it names.

    ``NAME`` may also be a function that takes no arguments and returns the toolbox.

    Raises:
        ValueError: ``spec`` is not ``MODULE:NAME``, or does not name a toolbox.
        ImportError: The module cannot be imported.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--toolbox must be MODULE:NAME (e.g. proj.agent:tools), got {spec!r}")
    module = importlib.import_module(module_name)
    try:
        value: Any = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r}") from None
    if inspect.isfunction(value):
        value = value()
    if not isinstance(value, Toolbox):
        raise ValueError(f"{spec} is a {type(value).__name__}, not a celery_idem.tools.Toolbox")
    return value


async def serve_stdio(mcp_server: Server[Any]) -> None:
    """Serve ``mcp_server`` on this process's stdin and stdout until the client closes them.

    Args:
        mcp_server: A server from :func:`server`.
    """
    async with stdio_server() as (read_stream, write_stream):
        await mcp_server.run(read_stream, write_stream,
                             mcp_server.create_initialization_options())


def serve_http(mcp_server: Server[Any], host: str, port: int, path: str = "/mcp") -> None:
    """Serve ``mcp_server`` over streamable HTTP at ``http://HOST:PORT/mcp`` (blocks).

    Uses uvicorn, which the MCP SDK installs. On a loopback ``host`` the SDK accepts only
    loopback ``Host`` and ``Origin`` headers (DNS-rebinding protection).

    Args:
        mcp_server: A server from :func:`server`.
        host: The address to listen on.
        port: The port to listen on.
        path: The endpoint's path.
    """
    import uvicorn

    app = mcp_server.streamable_http_app(streamable_http_path=path, host=host)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve(toolbox: Toolbox, http: tuple[str, int] | None = None, *,
          name: str = DEFAULT_NAME) -> None:
    """Serve ``toolbox`` on stdio, or over streamable HTTP when ``http`` is ``(host, port)``.

    What ``celery -A APP idem mcp`` runs; blocks until the client (stdio) or the process
    (HTTP) ends.

    Args:
        toolbox: The tools.
        http: ``(host, port)`` for streamable HTTP; None for stdio.
        name: The server's name in the handshake.
    """
    mcp_server = server(toolbox, name=name)
    if http is None:
        import anyio

        anyio.run(serve_stdio, mcp_server)
    else:
        serve_http(mcp_server, *http)
