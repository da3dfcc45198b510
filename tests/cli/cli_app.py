"""The integration app (tests/integration/app.py) with the settings some CLI tests change.

``celery -A tests.cli.cli_app idem ...`` is ``-A tests.integration.app`` plus, from the
environment: ``IDEM_ACCEPT`` (comma-separated ``accept_content`` and ``result_accept_content``,
e.g. ``json,pickle``) and ``IDEM_EVENTS=1`` (``idempotency_events = True``).
"""

from __future__ import annotations

import os

from tests.integration.app import app

__all__ = ["app"]

if os.environ.get("IDEM_ACCEPT"):
    accept = [name.strip() for name in os.environ["IDEM_ACCEPT"].split(",") if name.strip()]
    app.conf.accept_content = accept
    app.conf.result_accept_content = accept
if os.environ.get("IDEM_EVENTS") == "1":
    app.conf.idempotency_events = True
