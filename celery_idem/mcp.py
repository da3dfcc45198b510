"""The MCP server for a toolbox, under its first import path.

The code lives in :mod:`celery_idem.contrib.mcp`; this module re-exports every public name, so
``from celery_idem.mcp import server`` keeps working. Needs the ``[mcp]`` extra, as before.
"""

from __future__ import annotations

from .contrib.mcp import (
    DEFAULT_NAME,
    INSTRUCTIONS,
    load_toolbox,
    serve,
    serve_http,
    serve_stdio,
    server,
    text_of,
)

__all__ = ["DEFAULT_NAME", "INSTRUCTIONS", "load_toolbox", "serve", "serve_http", "serve_stdio",
           "server", "text_of"]
