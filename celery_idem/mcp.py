"""The MCP server for a toolbox, under its first import path.

The code lives in :mod:`celery_idem.contrib.mcp`; this module re-exports every public name, so
``from celery_idem.mcp import server`` keeps working. Needs the ``[mcp]`` extra, as before.
"""

from __future__ import annotations

from .contrib.mcp import (
    ALLOWED_HOSTS_ENV,
    ALLOWED_ORIGINS_ENV,
    DEFAULT_NAME,
    INSTRUCTIONS,
    MIN_TOKEN_LENGTH,
    TOKENS_ENV,
    StaticTokens,
    http_app,
    is_loopback,
    load_toolbox,
    scope_of,
    serve,
    serve_http,
    serve_stdio,
    server,
    text_of,
    transport_security,
)

__all__ = ["ALLOWED_HOSTS_ENV", "ALLOWED_ORIGINS_ENV", "DEFAULT_NAME", "INSTRUCTIONS",
           "MIN_TOKEN_LENGTH", "TOKENS_ENV", "StaticTokens", "http_app", "is_loopback", "load_toolbox",
           "scope_of", "serve", "serve_http", "serve_stdio", "server", "text_of", "transport_security"]
