"""The integration app plus the tasks of the result-id and result-encoding tests.

Workers run it with ``celery -A tests.integration.results_app``; the tasks of
tests/integration/app.py are registered too (the same app object).
"""

from __future__ import annotations

import time

from celery.result import AsyncResult, GroupResult

from celery_idem import IdempotentTask, TerminalError
from tests.integration.app import app, effect

__all__ = ["app", "echo", "echo_declined", "fail_held", "fail_released", "note", "plain_spawn",
           "spawn", "spawn_group"]


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


#: The lease of ``fail_held``: short, so a test can wait it out.
HELD_LEASE = 3.0


@app.task(base=IdempotentTask, bind=True, idempotency_lease=HELD_LEASE)
def fail_held(self, tag):  # type: ignore[no-untyped-def]
    """Fails with an ordinary bug (unclassified): the claim is held for the lease."""
    effect(f"fail_held:{tag}", time.time())
    raise ValueError(f"bug {tag}")


@app.task(base=IdempotentTask, bind=True, idempotency_release_on=(Exception,))
def fail_released(self, tag):  # type: ignore[no-untyped-def]
    """Fails with an ordinary bug, and says any error means "no effect": the claim is released
    (the default lease, 60 s, is never waited for)."""
    effect(f"fail_released:{tag}", time.time())
    raise ValueError(f"bug {tag}")


@app.task(base=IdempotentTask, bind=True)
def note(self, tag, label):  # type: ignore[no-untyped-def]
    """An errback (immutable): one effect per (tag, label)."""
    effect(f"note:{tag}", label)
    return label
