"""Per-principal limits of the MCP HTTP server: open sessions and request rate.

The SDK's session manager caps the sessions of all callers together, which one token opening
sessions in a loop fills for everyone. :class:`Limiter` gives each principal its own share:
past it, that principal alone is answered ``429 Too Many Requests`` with ``Retry-After``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from ..exceptions import InvalidKey
from ..keys import check_scope

__all__ = ["DEFAULT_MAX_SESSIONS", "DEFAULT_PRINCIPAL_SESSIONS", "DEFAULT_RATE_LIMIT",
           "DEFAULT_SESSION_IDLE_TIMEOUT", "MAX_REQUEST_BODY", "Limiter", "check_limits", "principal_of"]

logger = logging.getLogger("celery_idem.mcp")

#: Open sessions of all principals together; beyond it the SDK answers 503.
DEFAULT_MAX_SESSIONS = 1000
#: Open sessions of one principal; beyond it that principal is answered 429.
DEFAULT_PRINCIPAL_SESSIONS = 100
#: Seconds a session may go without a request before the server closes it.
DEFAULT_SESSION_IDLE_TIMEOUT = 600.0
#: Requests per second one principal may make, on average; it may burst to
#: :data:`BURST_SECONDS` times as many.
DEFAULT_RATE_LIMIT = 20.0
BURST_SECONDS = 5.0
#: Largest request body, in bytes: with no event store, a session holds no more than the
#: requests in flight, so this bounds its memory. A tool's arguments are far smaller.
MAX_REQUEST_BODY = 1 << 20


def principal_of(token: AccessToken) -> str:
    """Who a verified token stands for: its ``client_id`` when that is a valid scope name and
    the token names no ``subject``; otherwise a name made from the SDK's principal (client
    id, issuer, subject) as one hash, so two users of one OAuth client are two principals."""
    if token.subject is None:
        try:
            return check_scope(token.client_id)
        except InvalidKey:
            pass
    issuer = (token.claims or {}).get("iss")
    identity = json.dumps([token.client_id, issuer, token.subject], separators=(",", ":"))
    return "p." + hashlib.sha256(identity.encode()).hexdigest()[:32]


def check_limits(max_sessions: int, principal_sessions: int, rate_limit: float | None) -> None:
    """Raise ValueError naming the limit that is not a positive number, or a per-principal
    cap above the cap of all principals (one principal could then fill the server)."""
    if not 1 <= principal_sessions <= max_sessions:
        raise ValueError(f"principal_sessions must be from 1 to max_sessions ({max_sessions}), "
                         f"got {principal_sessions}")
    if rate_limit is not None and not (math.isfinite(rate_limit) and rate_limit > 0):
        raise ValueError(f"rate_limit must be a positive number of requests per second, "
                         f"got {rate_limit}")


class Limiter:
    """ASGI middleware, inside the SDK's bearer authentication: 429 for a principal past its
    open sessions or request rate (see :func:`~celery_idem.contrib.mcp.http_app`).

    Without tokens all callers are one principal, ``""``; with tokens a request without one
    passes on to the SDK's 401. ``sessions`` returns the session manager's open sessions by id:
    one closed by its client, its idle timeout or a crash leaves it, and frees its slot. When it
    returns None (an SDK without that table), sessions are capped by ``max_sessions`` only.
    """

    def __init__(self, app: Any, *, sessions: Callable[[], MutableMapping[str, Any] | None],
                 principal_sessions: int, rate_limit: float | None, authenticated: bool) -> None:
        self.app, self._sessions, self.authenticated = app, sessions, authenticated
        self.principal_sessions, self.rate_limit = principal_sessions, rate_limit
        self.burst = None if rate_limit is None else max(1.0, rate_limit * BURST_SECONDS)
        # Per principal: held by verified principals only, so its size is bounded by theirs.
        self._open: dict[str, set[str]] = {}
        self._opening: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        user = scope.get("user")
        if isinstance(user, AuthenticatedUser):
            who = principal_of(user.access_token)
        elif scope["type"] != "http" or self.authenticated:
            await self.app(scope, receive, send)  # the SDK answers 401 without a token
            return
        else:
            who = ""
        wait = self._take(who)
        if wait:
            logger.debug("celery_idem MCP: principal %r over its request rate", who)
            return await _too_many(f"principal {who!r} is over its request rate", wait,
                                   scope, receive, send)
        opening = scope.get("method") == "POST" and not any(
            name == b"mcp-session-id" for name, _ in scope.get("headers", ()))
        sessions = self._sessions() if opening else None  # closed or expired ones free their slot
        if sessions is None:
            await self.app(scope, receive, send)
            return
        live = self._open.setdefault(who, set())
        live.difference_update([sid for sid in live if sid not in sessions])
        if len(live) + self._opening.get(who, 0) >= self.principal_sessions:
            logger.warning("celery_idem MCP: principal %r refused a new session: it has %d open "
                           "(principal_sessions=%d)", who, len(live), self.principal_sessions)
            return await _too_many(f"principal {who!r} has {self.principal_sessions} open "
                                   f"sessions: close one, or let one expire", 1.0,
                                   scope, receive, send)

        async def watch(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                for name, value in message.get("headers", ()):
                    if name.lower() == b"mcp-session-id":
                        live.add(value.decode("latin-1"))
            await send(message)

        # Counted while it opens: a burst of opening requests cannot pass the cap together.
        self._opening[who] = self._opening.get(who, 0) + 1
        try:
            await self.app(scope, receive, watch)
        finally:
            self._opening[who] -= 1

    def _take(self, who: str) -> float:
        """Take one request from ``who``'s token bucket: 0, or the seconds until it may retry."""
        if self.rate_limit is None or self.burst is None:
            return 0.0
        now = time.monotonic()
        tokens, then = self._buckets.get(who, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate_limit)
        if tokens < 1.0:
            self._buckets[who] = (tokens, now)
            return (1.0 - tokens) / self.rate_limit
        self._buckets[who] = (tokens - 1.0, now)
        return 0.0


async def _too_many(message: str, retry_after: float, scope: Any, receive: Any,
                    send: Any) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": -32000, "message": message}}).encode()
    await send({"type": "http.response.start", "status": 429, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(max(1, math.ceil(retry_after))).encode())]})
    await send({"type": "http.response.body", "body": body})
