"""The integration app plus the tasks of the result-id and result-encoding tests.

Workers run it with ``celery -A tests.integration.results_app``; the tasks of
tests/integration/app.py are registered too (the same app object).
"""

from __future__ import annotations

from celery.result import AsyncResult, GroupResult

from celery_idem import IdempotentTask, TerminalError
from tests.integration.app import app, effect

__all__ = ["app", "echo", "echo_declined", "plain_spawn", "spawn", "spawn_group"]


@app.task(base=IdempotentTask, bind=True)
def echo(self, value):  # type: ignore[no-untyped-def]
    """Keyed by ``value``: a chain ``echo.s(v) | echo.s()`` repeats step 1's action in step 2."""
    effect(f"echo:{value}", self.request.id)
    return value


@app.task(base=IdempotentTask, bind=True)
def echo_declined(self, value):  # type: ignore[no-untyped-def]
    """Fails terminally: the record holds the error."""
    effect(f"declined:{value}", self.request.id)
    raise TerminalError(f"declined {value}")


@app.task(base=IdempotentTask, bind=True)
def spawn(self, name):  # type: ignore[no-untyped-def]
    """Returns an AsyncResult, which Celery stores as its ``as_tuple()``."""
    effect(f"spawn:{name}", self.request.id)
    return AsyncResult(f"{name}-child", app=app)


@app.task(bind=True)
def plain_spawn(self, name):  # type: ignore[no-untyped-def]
    """The plain Celery twin of ``spawn`` (what Celery's own get() returns)."""
    return AsyncResult(f"{name}-child", app=app)


@app.task(base=IdempotentTask, bind=True)
def spawn_group(self, name):  # type: ignore[no-untyped-def]
    """Returns a GroupResult."""
    effect(f"spawn_group:{name}", self.request.id)
    return GroupResult(f"{name}-group", [AsyncResult(f"{name}-a", app=app),
                                         AsyncResult(f"{name}-b", app=app)], app=app)
