"""An MCP server for a :class:`~celery_idem.contrib.tools.Toolbox`: the same tools, over MCP.

Needs the official MCP Python SDK (``pip install 'celery-idem[mcp]'``)::

    celery -A proj idem mcp --toolbox proj.agent:tools [--http 127.0.0.1:8765]

or, embedded: ``http_app(server(tools), "127.0.0.1", 8765)`` / ``await serve_stdio(server(tools))``.

Each tool is listed with its input schema, :data:`~celery_idem.contrib.tools.OUTCOME_SCHEMA` as
output schema and its annotations (write tools ``idempotentHint``, read tools ``readOnlyHint``).
A call runs through :meth:`~celery_idem.contrib.tools.Toolbox.acall` (the event loop never
blocks on a task) and answers the outcome dict as ``structuredContent`` plus a short text;
``isError`` is set for ``error`` and ``forbidden`` only. The key is derived from the arguments
exactly as for the task: the JSON-RPC request id, the session and ``_meta`` are not part of it.

Over HTTP the SDK's ``Host`` / ``Origin`` allow-list is always on, a bind that is not loopback
requires bearer tokens, and each principal has its own share of sessions and request rate
(:mod:`~celery_idem.contrib.mcp_limits`).
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
from starlette.middleware import Middleware

from ..exceptions import ImproperlyConfigured, InvalidKey
from ..keys import check_scope
from . import mcp_limits
from .mcp_limits import Limiter, check_limits, principal_of
from .tools import MAX_MESSAGE, Toolbox

__all__ = ["ALLOWED_HOSTS_ENV", "ALLOWED_ORIGINS_ENV", "INSTRUCTIONS", "MIN_TOKEN_LENGTH",
           "TOKENS_ENV", "PrincipalToken", "StaticTokens", "http_app", "is_loopback", "load_toolbox",
           "principal_of", "scope_of", "serve", "serve_http", "serve_stdio", "server", "text_of",
           "transport_security"]

logger = logging.getLogger("celery_idem.mcp")

#: The environment variable with the bearer tokens the HTTP server accepts:
#: ``PRINCIPAL[@SCOPE]:TOKEN`` entries separated by commas or whitespace (see
#: :class:`StaticTokens` for what ``@SCOPE`` and a bare ``@`` mean).
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
           caller_scope: Callable[[AccessToken], str | None] | None = None) -> Server[Any]:
    """Make an MCP server that serves every tool of ``toolbox``.

    An authenticated caller's call (a bearer token, over HTTP) runs in its token's scope
    (:func:`scope_of`) as its principal (:func:`principal_of`, what ``authorize`` sees); an
    unauthenticated one in the toolbox's :attr:`~celery_idem.contrib.tools.Toolbox.scope`.

    Args:
        toolbox: The tools.
        name: The server's name in the handshake.
        instructions: Text the client may give the model about the tools as a whole
            (default :data:`INSTRUCTIONS`).
        caller_scope: The scope of an authenticated caller's token (default
            :func:`scope_of`): a valid scope, or None for the toolbox's.

    Returns:
        An ``mcp.server.lowlevel.Server``: run it on stdio (:func:`serve_stdio`), serve it
        with :func:`http_app`, or pass it to ``mcp.Client`` in a test.
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
        # scope and principal are the authenticated caller's, never anything the client sends.
        token = _caller_token(ctx)
        outcome = await toolbox.acall(
            params.name, params.arguments or {},
            scope=None if token is None else to_scope(token),
            principal=None if token is None else principal_of(token))
        return types.CallToolResult(
            content=[types.TextContent(text=text_of(outcome))],
            structured_content=outcome,
            is_error=outcome.get("status") in ("error", "forbidden"),
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


class PrincipalToken(AccessToken):
    """A :class:`StaticTokens` token: principal ``client_id``, scope ``tenant`` (None: none)."""

    tenant: str | None = None


def scope_of(token: AccessToken) -> str | None:
    """The scope of an authenticated caller's calls.

    A :class:`StaticTokens` token's configured scope (None: the toolbox's); for any other
    verifier's token, its principal (:func:`~celery_idem.contrib.mcp_limits.principal_of`).
    """
    return token.tenant if isinstance(token, PrincipalToken) else principal_of(token)


class StaticTokens(TokenVerifier):
    """An SDK ``TokenVerifier`` for a fixed set of bearer tokens, each naming a principal and
    the scope (tenant) of its calls.

    Args:
        tokens: ``{token: "PRINCIPAL"}`` (the principal is its own scope),
            ``{token: "PRINCIPAL@SCOPE"}`` (several principals can share one scope), or
            ``{token: "PRINCIPAL@"}`` (no scope: the toolbox's, the one stdio calls use, for a
            deployment with one tenant). Principals and scopes are 1 to 64 characters of
            ``A-Z a-z 0-9 . _ ~ + = / -``; a token is at least :data:`MIN_TOKEN_LENGTH`
            printable characters without spaces or commas.

    Raises:
        ValueError: No tokens, a token too short or with spaces, or a principal or scope that
            is not a valid scope name.
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        if not tokens:
            raise ValueError("StaticTokens needs at least one token")
        self._principals: dict[bytes, tuple[str, str | None]] = {}
        for token, who in tokens.items():
            principal, at, tenant = str(who).partition("@")
            scope = (tenant or None) if at else principal
            _check_token(token, principal, scope)
            # Held by digest: a lookup's timing says nothing about a stored token's text.
            self._principals[_digest(token)] = (principal, scope)

    @classmethod
    def from_text(cls, text: str) -> StaticTokens:
        """Read :data:`TOKENS_ENV`'s ``PRINCIPAL[@SCOPE]:TOKEN`` entries (ValueError if one is
        malformed, or as :class:`StaticTokens`)."""
        tokens: dict[str, str] = {}
        for n, pair in enumerate((p for p in re.split(r"[\s,]+", text) if p), 1):
            principal, sep, token = pair.partition(":")
            if not sep:
                raise ValueError(f"{TOKENS_ENV}: entry {n} is not PRINCIPAL[@SCOPE]:TOKEN")
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

    def scopes(self) -> dict[str, str | None]:
        """Each principal's scope (None: the toolbox's), for the server's start-up line."""
        return dict(sorted(self._principals.values()))

    async def verify_token(self, token: str) -> AccessToken | None:
        """The principal and scope of ``token`` (a :class:`PrincipalToken`), or None."""
        found = self._principals.get(_digest(token))
        if found is None:
            return None
        return PrincipalToken(token=token, client_id=found[0], scopes=[], tenant=found[1])


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _check_token(token: Any, principal: str, tenant: str | None) -> None:
    for what, name in (("principal", principal), ("scope", tenant or principal)):
        try:
            check_scope(name)
        except InvalidKey as exc:
            raise ValueError(f"MCP {what} {name!r}: {exc}") from None
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
             auth: AuthSettings | None = None, max_sessions: int = mcp_limits.DEFAULT_MAX_SESSIONS,
             principal_sessions: int = mcp_limits.DEFAULT_PRINCIPAL_SESSIONS,
             session_idle_timeout: float = mcp_limits.DEFAULT_SESSION_IDLE_TIMEOUT,
             rate_limit: float | None = mcp_limits.DEFAULT_RATE_LIMIT) -> Any:
    """The streamable HTTP app of ``mcp_server`` (a Starlette app), locked down for ``host``.

    The ``Host`` / ``Origin`` allow-list (:func:`transport_security`) is on whatever the
    bind. With ``token_verifier`` every request needs ``Authorization: Bearer <token>`` (401
    otherwise), and each call runs in its token's scope (:func:`scope_of`). A ``host`` that is
    not a loopback address requires a ``token_verifier``. A principal past
    ``principal_sessions`` or ``rate_limit`` is answered 429; other principals are not.

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
        max_sessions: Open sessions of all principals together (503 beyond).
        principal_sessions: Open sessions of one principal (429 beyond).
        session_idle_timeout: Seconds after which a session without requests is closed.
        rate_limit: Requests per second per principal, on average (429 beyond); None: none.

    Raises:
        ImproperlyConfigured: ``host`` is not loopback and there is no ``token_verifier``.
        ValueError: A limit that is not a positive number.
    """
    if token_verifier is None and not is_loopback(host):
        raise ImproperlyConfigured(
            f"refusing to serve MCP on {host}:{port} without authentication: anyone who reaches "
            f"the port could call the write tools. Set {TOKENS_ENV}='PRINCIPAL[@SCOPE]:TOKEN[,...]', "
            f"pass token_verifier=, or bind a loopback address (127.0.0.1) behind your own "
            f"authenticating proxy.")
    check_limits(max_sessions, principal_sessions, rate_limit)
    if token_verifier is not None and auth is None:
        # The SDK installs its bearer middleware only with AuthSettings; this server issues no
        # tokens, so the issuer is only a placeholder and no metadata route is made.
        auth = AuthSettings(issuer_url=f"http://{_url_host(host)}:{port}",  # type: ignore[arg-type]
                            resource_server_url=None, required_scopes=[])
    security = transport_security(host, allowed_hosts, allowed_origins)
    app = mcp_server.streamable_http_app(
        streamable_http_path=path, host=host, transport_security=security,
        token_verifier=token_verifier, auth=auth, max_sessions=max_sessions,
        session_idle_timeout=session_idle_timeout, max_request_body_size=mcp_limits.MAX_REQUEST_BODY)
    manager = mcp_server.session_manager
    # Innermost, after the SDK's bearer middleware has named the caller. The session
    # manager's own table is the one source of which sessions are still open: a private name
    # (mcp 2.3; tests/unit/test_private_names.py), and without it only max_sessions applies.
    app.user_middleware.append(Middleware(
        Limiter, sessions=lambda: getattr(manager, "_server_instances", None),
        principal_sessions=principal_sessions, rate_limit=rate_limit,
        authenticated=token_verifier is not None))
    return app


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
    """Serve ``mcp_server`` (from :func:`server`) on stdin and stdout until the client closes them."""
    async with stdio_server() as (read_stream, write_stream):
        await mcp_server.run(read_stream, write_stream,
                             mcp_server.create_initialization_options())


def serve_http(mcp_server: Server[Any], host: str, port: int, path: str = "/mcp", *,
               token_verifier: TokenVerifier | None = None,
               environ: Mapping[str, str] | None = None,
               announce: Callable[[str], None] | None = None, **limits: Any) -> None:
    """Serve :func:`http_app` of ``mcp_server`` with uvicorn at ``http://HOST:PORT/mcp`` (blocks).

    Without ``token_verifier``, the tokens of :data:`TOKENS_ENV` are required when it is set;
    :data:`ALLOWED_HOSTS_ENV` and :data:`ALLOWED_ORIGINS_ENV` extend the allow-list.

    Args:
        mcp_server: A server from :func:`server`.
        host: The address to listen on.
        port: The port to listen on.
        path: The endpoint's path.
        token_verifier: Checks bearer tokens (default: :data:`TOKENS_ENV`, if set).
        environ: Where to read the environment variables (default ``os.environ``).
        announce: Told where the server is and each principal's scope, once the
            configuration is checked and before the server listens.
        **limits: ``max_sessions``, ``principal_sessions``, ``session_idle_timeout`` and
            ``rate_limit``, as for :func:`http_app`.

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
    app = http_app(mcp_server, host, port, path, token_verifier=token_verifier,
                   allowed_hosts=allowed_hosts,
                   allowed_origins=_csv(env.get(ALLOWED_ORIGINS_ENV)), **limits)
    # After http_app's checks: a refused start says only why it was refused.
    if host.strip("[]") in ("0.0.0.0", "::") and not allowed_hosts:
        logger.warning("celery_idem MCP server on %s:%s accepts the Host names of this machine "
                       "(%s) only: set %s to the names clients use", host, port,
                       socket.getfqdn(), ALLOWED_HOSTS_ENV)
    if announce is not None:
        if isinstance(token_verifier, StaticTokens):
            scopes = ", ".join(f"{p} in {s or 'no scope'}"
                               for p, s in token_verifier.scopes().items())
        else:
            scopes = ("each token's principal" if token_verifier is not None
                      else "no token: the toolbox's scope")
        announce(f"http://{_url_host(host)}:{port}{path}; scope: {scopes}")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve(toolbox: Toolbox, http: tuple[str, int] | None = None, *,
          name: str = DEFAULT_NAME, token_verifier: TokenVerifier | None = None,
          announce: Callable[[str], None] | None = None, **limits: Any) -> None:
    """Serve ``toolbox`` on stdio, or with :func:`serve_http` when ``http`` is ``(host, port)``.

    What ``celery -A APP idem mcp`` runs; blocks until the client (stdio) or the process
    (HTTP) ends. ``token_verifier``, ``announce`` and ``**limits`` are as for :func:`serve_http`
    (``announce`` on stdio too).

    Raises:
        ImproperlyConfigured: As :func:`serve_http`; checked before anything listens.
    """
    mcp_server = server(toolbox, name=name)
    if http is not None:
        serve_http(mcp_server, *http, token_verifier=token_verifier, announce=announce, **limits)
        return
    import anyio

    if announce is not None:
        announce(f"stdio; scope: {toolbox.scope or 'none'}")
    anyio.run(serve_stdio, mcp_server)
