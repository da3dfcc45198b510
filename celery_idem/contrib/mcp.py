"""An MCP server for a :class:`~celery_idem.contrib.tools.Toolbox`: the same tools, over MCP.

Needs the official MCP Python SDK (``pip install 'celery-idem[mcp]'``). From a shell::

    celery -A proj idem mcp --toolbox proj.agent:tools                      # stdio
    celery -A proj idem mcp --toolbox proj.agent:tools --http 127.0.0.1:8765  # streamable HTTP

Embedded in Python::

    from celery_idem.contrib.mcp import http_app, server

    mcp_server = server(tools)        # an mcp.server.lowlevel.Server
    app = http_app(mcp_server, "127.0.0.1", 8765)   # or: await serve_stdio(mcp_server)

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

Over HTTP (:func:`serve_http`, :func:`http_app`) the ``Host`` / ``Origin`` allow-list of the
SDK (DNS-rebinding protection) is always on, and a server bound to anything but a loopback
address requires a bearer token: ``CELERY_IDEM_MCP_TOKENS="alice:<token>,bob:<token>"`` (or an
SDK ``TokenVerifier``). Each caller's principal is the scope of its calls
(:meth:`~celery_idem.contrib.tools.Toolbox.acall`'s ``scope``): the same key from two callers
is two actions, and no caller reads another's results.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import ipaddress
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mcp import types
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings

from ..exceptions import ImproperlyConfigured, InvalidKey
from ..keys import check_scope
from .tools import MAX_MESSAGE, Toolbox

__all__ = ["ALLOWED_HOSTS_ENV", "ALLOWED_ORIGINS_ENV", "INSTRUCTIONS", "MIN_TOKEN_LENGTH",
           "TOKENS_ENV", "StaticTokens", "http_app", "is_loopback", "load_toolbox", "scope_of", "serve",
           "serve_http", "serve_stdio", "server", "text_of", "transport_security"]

logger = logging.getLogger("celery_idem.mcp")

#: The environment variable with the bearer tokens the HTTP server accepts: ``PRINCIPAL:TOKEN``
#: pairs separated by commas or whitespace. The principal (a scope name: ``A-Z a-z 0-9 . _ ~
#: + = / -``) becomes the scope of that caller's calls.
TOKENS_ENV = "CELERY_IDEM_MCP_TOKENS"
#: More ``Host`` header values the HTTP server accepts (comma-separated ``name`` or
#: ``name:port``): the names clients reach it by, behind a proxy or on a wildcard bind.
ALLOWED_HOSTS_ENV = "CELERY_IDEM_MCP_ALLOWED_HOSTS"
#: More ``Origin`` header values the HTTP server accepts (comma-separated, e.g.
#: ``https://agents.example.com``); requests without an ``Origin`` (non-browser clients) pass.
ALLOWED_ORIGINS_ENV = "CELERY_IDEM_MCP_ALLOWED_ORIGINS"
#: Shortest bearer token accepted: a token is a secret, not a password to remember.
MIN_TOKEN_LENGTH = 24

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")

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
           instructions: str | None = None,
           caller_scope: Callable[[AccessToken], str] | None = None) -> Server[Any]:
    """Make an MCP server that serves every tool of ``toolbox``.

    A call from an authenticated caller (a bearer token, over HTTP) runs in that caller's
    scope; an unauthenticated one (stdio, loopback HTTP without tokens) in the toolbox's own
    :attr:`~celery_idem.contrib.tools.Toolbox.scope`.

    Args:
        toolbox: The tools.
        name: The server's name in the handshake.
        instructions: Text the client may give the model about the tools as a whole
            (default :data:`INSTRUCTIONS`).
        caller_scope: The scope of an authenticated caller's token (default
            :func:`scope_of`); it must return a valid scope.

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

    to_scope = scope_of if caller_scope is None else caller_scope

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        # Only the tool's name and arguments go on: ctx.request_id and params.meta are the
        # client's per-request data and must not make a retried call a different action. The
        # scope is the authenticated caller's, never anything the client sends.
        token = _caller_token(ctx)
        outcome = await toolbox.acall(params.name, params.arguments or {},
                                      scope=None if token is None else to_scope(token))
        return types.CallToolResult(
            content=[types.TextContent(text=text_of(outcome))],
            structured_content=outcome,
            is_error=outcome.get("status") == "error",
        )

    return Server(name, instructions=INSTRUCTIONS if instructions is None else instructions,
                  on_list_tools=list_tools, on_call_tool=call_tool)


def _caller_token(ctx: Any) -> AccessToken | None:
    """The verified token of the caller of this request, or None (unauthenticated)."""
    # First the HTTP request this message came in (the SDK's bearer middleware put its user
    # there); then the SDK's context variable (set around a request, inherited by a session's
    # task from the request that opened it: the same principal, as the SDK binds sessions).
    request = getattr(ctx, "request", None)
    scope = getattr(request, "scope", None)
    user = scope.get("user") if isinstance(scope, Mapping) else None
    found = getattr(user, "access_token", None)
    return found if isinstance(found, AccessToken) else get_access_token()


def scope_of(token: AccessToken) -> str:
    """The scope of an authenticated caller: its principal.

    The token's ``client_id`` when it is a valid scope and the token names no ``subject``
    (:class:`StaticTokens` gives each principal its own ``client_id``); otherwise a name made
    from the SDK's principal (client id, issuer, subject) as one hash, so two users of one
    OAuth client are two scopes.
    """
    if token.subject is None:
        try:
            return check_scope(token.client_id)
        except InvalidKey:
            pass
    issuer = (token.claims or {}).get("iss")
    identity = json.dumps([token.client_id, issuer, token.subject], separators=(",", ":"))
    return "p." + hashlib.sha256(identity.encode()).hexdigest()[:32]


class StaticTokens(TokenVerifier):
    """An SDK ``TokenVerifier`` for a fixed set of bearer tokens, each mapped to a principal.

    Args:
        tokens: ``{token: principal}``. A principal is a scope name (1 to 64 characters of
            ``A-Z a-z 0-9 . _ ~ + = / -``); a token is at least :data:`MIN_TOKEN_LENGTH`
            printable characters without spaces or commas.

    Raises:
        ValueError: No tokens, a token too short or with spaces, or a principal that is not a
            valid scope.
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not tokens:
            raise ValueError("StaticTokens needs at least one token")
        self._principals: dict[bytes, str] = {}
        for token, principal in tokens.items():
            _check_token(token, principal)
            # Held by digest: a lookup's timing says nothing about a stored token's text.
            self._principals[_digest(token)] = principal

    @classmethod
    def from_text(cls, text: str) -> StaticTokens:
        """Read ``PRINCIPAL:TOKEN`` pairs separated by commas or whitespace (:data:`TOKENS_ENV`).

        Raises:
            ValueError: A pair without ``:``, or as :class:`StaticTokens` raises.
        """
        tokens: dict[str, str] = {}
        for n, pair in enumerate((p for p in re.split(r"[\s,]+", text) if p), 1):
            principal, sep, token = pair.partition(":")
            if not sep:
                raise ValueError(f"{TOKENS_ENV}: entry {n} is not PRINCIPAL:TOKEN")
            if token in tokens:
                raise ValueError(f"{TOKENS_ENV}: entry {n} repeats another entry's token")
            tokens[token] = principal
        return cls(tokens)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StaticTokens | None:
        """The tokens of :data:`TOKENS_ENV`, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(TOKENS_ENV, "").strip()
        return cls.from_text(text) if text else None

    def __len__(self) -> int:
        return len(self._principals)

    async def verify_token(self, token: str) -> AccessToken | None:
        """The principal of ``token`` (as its ``client_id``), or None for an unknown token."""
        principal = self._principals.get(_digest(token))
        if principal is None:
            return None
        return AccessToken(token=token, client_id=principal, scopes=[])


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _check_token(token: Any, principal: Any) -> None:
    try:
        check_scope(principal)
    except InvalidKey as exc:
        raise ValueError(f"MCP principal {principal!r}: {exc}") from None
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the token of principal {principal!r} is shorter than "
                         f"{MIN_TOKEN_LENGTH} characters: use a random one, e.g. "
                         f"python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if not token.isprintable() or any(c.isspace() or c == "," for c in token):
        raise ValueError(f"the token of principal {principal!r} has spaces, commas or "
                         f"control characters")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) can be reached from this machine only."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def _with_port(name: str) -> list[str]:
    """Host header patterns for ``name``: itself (a proxy on the default port) and any port."""
    name = name.strip()
    if (re.search(r":\d+$", name) and not name.endswith("]")) or name.endswith(":*"):
        return [name]
    return [name, f"{name}:*"]


def _csv(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def transport_security(host: str, allowed_hosts: Iterable[str] = (),
                       allowed_origins: Iterable[str] = ()) -> TransportSecuritySettings:
    """The SDK's ``Host`` / ``Origin`` allow-list for a server bound to ``host``: always on.

    Allowed: the loopback names (``127.0.0.1``, ``localhost``, ``[::1]``, any port); the bound
    address itself; on a wildcard bind (``0.0.0.0``, ``::``) this machine's host name and
    fully qualified name; and ``allowed_hosts`` (``name`` or ``name:port``). Origins: ``http``
    and ``https`` on each of those names, and ``allowed_origins``. A request with any other
    ``Host`` is answered 421, with any other ``Origin`` 403 (DNS-rebinding protection).

    Args:
        host: The address the server listens on.
        allowed_hosts: More host names clients use (a proxy's, a DNS name).
        allowed_origins: More origins (``https://agents.example.com``).
    """
    bare = host.strip("[]")
    names = list(_LOOPBACK_HOSTS)
    if bare in ("0.0.0.0", "::", ""):
        names += [socket.gethostname(), socket.getfqdn()]
    else:
        names.append(f"[{bare}]" if ":" in bare else bare)
    names = list(dict.fromkeys(n for n in names if n))
    hosts = [pattern for n in [*names, *allowed_hosts] for pattern in _with_port(n)]
    origins = [f"{scheme}://{n}{port}" for n in names for scheme in ("http", "https")
               for port in ("", ":*")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=list(dict.fromkeys(hosts)),
        allowed_origins=list(dict.fromkeys([*origins, *allowed_origins])))


def http_app(mcp_server: Server[Any], host: str, port: int, path: str = "/mcp", *,
             token_verifier: TokenVerifier | None = None,
             allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
             auth: AuthSettings | None = None) -> Any:
    """The streamable HTTP app of ``mcp_server`` (a Starlette app), locked down for ``host``.

    The ``Host`` / ``Origin`` allow-list (:func:`transport_security`) is on whatever the
    bind. With ``token_verifier`` every request needs ``Authorization: Bearer <token>`` (401
    otherwise), and each call runs in its caller's scope. A ``host`` that is not a loopback
    address requires a ``token_verifier``.

    Args:
        mcp_server: A server from :func:`server`.
        host: The address the app will listen on.
        port: The port it will listen on.
        path: The endpoint's path.
        token_verifier: Checks bearer tokens (:class:`StaticTokens`, or any SDK
            ``TokenVerifier``, such as one that introspects OAuth tokens).
        allowed_hosts: More ``Host`` values to accept (see :func:`transport_security`).
        allowed_origins: More ``Origin`` values to accept.
        auth: The SDK's ``AuthSettings`` (OAuth resource-server metadata, required token
            scopes), for a ``token_verifier`` that checks OAuth tokens.

    Raises:
        ImproperlyConfigured: ``host`` is not loopback and there is no ``token_verifier``.
    """
    if token_verifier is None and not is_loopback(host):
        raise ImproperlyConfigured(
            f"refusing to serve MCP on {host}:{port} without authentication: anyone who reaches "
            f"the port could call the write tools. Set {TOKENS_ENV}='PRINCIPAL:TOKEN[,...]' "
            f"(each principal is its callers' scope), pass token_verifier=, or bind a loopback "
            f"address (127.0.0.1) behind your own authenticating proxy.")
    if token_verifier is not None and auth is None:
        # The SDK installs its bearer middleware only with AuthSettings; this server issues no
        # tokens, so the issuer is only a placeholder and no metadata route is made.
        auth = AuthSettings(issuer_url=f"http://{_url_host(host)}:{port}",  # type: ignore[arg-type]
                            resource_server_url=None, required_scopes=[])
    security = transport_security(host, allowed_hosts, allowed_origins)
    return mcp_server.streamable_http_app(
        streamable_http_path=path, host=host, transport_security=security,
        token_verifier=token_verifier, auth=auth)


def _url_host(host: str) -> str:
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else (bare or "127.0.0.1")


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
        raise ValueError(f"{spec} is a {type(value).__name__}, not a celery_idem.contrib.tools.Toolbox")
    return value


async def serve_stdio(mcp_server: Server[Any]) -> None:
    """Serve ``mcp_server`` on this process's stdin and stdout until the client closes them.

    Args:
        mcp_server: A server from :func:`server`.
    """
    async with stdio_server() as (read_stream, write_stream):
        await mcp_server.run(read_stream, write_stream,
                             mcp_server.create_initialization_options())


def serve_http(mcp_server: Server[Any], host: str, port: int, path: str = "/mcp", *,
               token_verifier: TokenVerifier | None = None,
               environ: Mapping[str, str] | None = None) -> None:
    """Serve ``mcp_server`` over streamable HTTP at ``http://HOST:PORT/mcp`` (blocks).

    Uses uvicorn, which the MCP SDK installs. The ``Host`` / ``Origin`` allow-list is always
    on (:func:`transport_security`, plus :data:`ALLOWED_HOSTS_ENV` and
    :data:`ALLOWED_ORIGINS_ENV`). Without ``token_verifier``, the tokens of :data:`TOKENS_ENV`
    are required when it is set; a ``host`` that is not loopback refuses to start without
    either.

    Args:
        mcp_server: A server from :func:`server`.
        host: The address to listen on.
        port: The port to listen on.
        path: The endpoint's path.
        token_verifier: Checks bearer tokens (default: :data:`TOKENS_ENV`, if set).
        environ: Where to read the environment variables (default ``os.environ``).

    Raises:
        ImproperlyConfigured: Not loopback and no authentication, or :data:`TOKENS_ENV` is
            malformed.
    """
    import uvicorn

    env = os.environ if environ is None else environ
    if token_verifier is None:
        try:
            token_verifier = StaticTokens.from_env(env)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
    allowed_hosts = _csv(env.get(ALLOWED_HOSTS_ENV))
    if host.strip("[]") in ("0.0.0.0", "::") and not allowed_hosts:
        logger.warning("celery_idem MCP server on %s:%s accepts the Host names of this machine "
                       "(%s) only: set %s to the names clients use", host, port,
                       socket.getfqdn(), ALLOWED_HOSTS_ENV)
    app = http_app(mcp_server, host, port, path, token_verifier=token_verifier,
                   allowed_hosts=allowed_hosts,
                   allowed_origins=_csv(env.get(ALLOWED_ORIGINS_ENV)))
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve(toolbox: Toolbox, http: tuple[str, int] | None = None, *,
          name: str = DEFAULT_NAME, token_verifier: TokenVerifier | None = None) -> None:
    """Serve ``toolbox`` on stdio, or over streamable HTTP when ``http`` is ``(host, port)``.

    What ``celery -A APP idem mcp`` runs; blocks until the client (stdio) or the process
    (HTTP) ends.

    Args:
        toolbox: The tools.
        http: ``(host, port)`` for streamable HTTP; None for stdio.
        name: The server's name in the handshake.
        token_verifier: For HTTP: checks bearer tokens (default: :data:`TOKENS_ENV`).

    Raises:
        ImproperlyConfigured: HTTP on an address that is not loopback without authentication
            (the message says what to set); checked before anything listens.
    """
    mcp_server = server(toolbox, name=name)
    if http is None:
        import anyio

        anyio.run(serve_stdio, mcp_server)
    else:
        serve_http(mcp_server, *http, token_verifier=token_verifier)
