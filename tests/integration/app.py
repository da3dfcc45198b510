"""The Celery app the integration tests run in real ``celery worker`` processes.

Configured from the environment so every test gets its own queue, key prefix and ledger:
``IDEM_BROKER``, ``IDEM_BACKEND``, ``IDEM_STORE`` (default: the backend), ``IDEM_PREFIX``,
``IDEM_QUEUE``, ``IDEM_LEDGER`` (a Redis URL where bodies count their effects).

Every body appends to the ledger list ``<prefix>ledger:<name>`` *before* it returns, so the
ledger counts executions of the side effect, independently of the store under test.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_idem.delivery
from celery_idem import IdempotentTask, TerminalError

PREFIX = os.environ.get("IDEM_PREFIX", "itest:")
app = Celery("itest", broker=os.environ.get("IDEM_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("IDEM_BACKEND", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue=os.environ.get("IDEM_QUEUE", "itest"),
    idempotency_key_prefix=PREFIX,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Fast crash recovery for the SIGKILL tests (see celery-behaviour.md, finding 8): a dead
    # worker's message comes back once it is older than the visibility timeout, at the next scan.
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("IDEM_VISIBILITY", "3600")),
        "unacked_restore_interval": float(os.environ.get("IDEM_RESTORE_INTERVAL", "1")),
        "unacked_restore_throttle": int(os.environ.get("IDEM_RESTORE_THROTTLE", "1")),
    },
)
if os.environ.get("IDEM_STORE"):
    app.conf.idempotency_store = os.environ["IDEM_STORE"]
if os.environ.get("IDEM_FOLD") == "0":  # the control of test_result_fold.py
    app.conf.idempotency_fold_results = False

_ledger = redis.Redis.from_url(os.environ.get("IDEM_LEDGER", "redis://127.0.0.1:6379/0"))


def effect(name: str, value: object = 1) -> int:
    """Commit one side effect to the ledger; returns how many there are now."""
    return int(_ledger.rpush(f"{PREFIX}ledger:{name}", str(value)))


def flag(name: str) -> bool:
    return bool(_ledger.exists(f"{PREFIX}flag:{name}"))


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def charge(self, order_id, amount_cents, note="", hold=0.0):
    """Charge once; ``hold`` keeps the body running (to test leases and concurrency)."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    n = effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "charged": amount_cents, "effects": n,
            "token": self.idempotency_token, "key": self.idempotency_key}


@app.task(base=IdempotentTask, bind=True, autoretry_for=(TimeoutError,),
          retry_backoff=False, default_retry_delay=0, max_retries=5,
          idempotency_fields=("order_id",))
def flaky(self, order_id, fail_times=2):
    """Times out ``fail_times`` times before the effect (nothing committed), then succeeds."""
    attempts = effect(f"attempt:{order_id}")
    effect(f"token:{order_id}", self.idempotency_token)
    if attempts <= fail_times:
        raise TimeoutError(f"provider timed out (attempt {attempts})")
    effect(f"charge:{order_id}")
    return {"order_id": order_id, "attempts": attempts, "retries": self.request.retries}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def declined(self, order_id):
    effect(f"charge:{order_id}")
    raise TerminalError(f"card declined for {order_id}")


@app.task(base=IdempotentTask, bind=True, idempotency_validate=True)
def validated(self, order_id, amount_cents):
    effect(f"charge:{order_id}")
    return amount_cents


@app.task(base=IdempotentTask, bind=True)
def get_salary(self, employee):
    """Another operation's record, with data a refund's caller must never read."""
    effect(f"salary:{employee}")
    return {"employee": employee, "salary": 123_456, "ssn": "078-05-1120"}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id", "amount_cents"))
def refund(self, order_id, amount_cents, note="", hold=0.0):
    """A refund keyed per call by its callers (agents)."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"refund:{order_id}", self.request.id)
    return {"refunded": order_id, "amount_cents": amount_cents, "key": self.idempotency_key}


def _held_action(self, order_id, hold, marker):  # type: ignore[no-untyped-def]
    if marker:  # the pid first, so a test can kill the process running the body
        with open(marker, "a") as fh:
            fh.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"action:{order_id}", self.request.id)
    return {"order_id": order_id, "task_id": self.request.id, "token": self.idempotency_token}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=3)
def held_action(self, order_id, hold=0.0, marker=""):
    """Runs up to ``hold`` s (or until released), then commits one effect."""
    return _held_action(self, order_id, hold, marker)


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=3,
          idempotency_check_on_enqueue=False)
def held_action_unchecked(self, order_id, hold=0.0, marker=""):
    """``held_action`` with the enqueue check off: every copy is published."""
    return _held_action(self, order_id, hold, marker)


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def add_step(self, total, order_id):
    """A canvas step: adds one to ``total``."""
    effect(f"step:{order_id}")
    return total + 1


@app.task
def plain(order_id):
    """A plain Celery task (for comparisons)."""
    effect(f"plain:{order_id}")
    return order_id


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_lease=2,
          idempotency_wait=15)
def slow_charge(self, order_id, marker, hold):
    """Writes its pid to ``marker`` (its token to ``marker.tokens``), then runs up to ``hold`` s
    (or until released), then charges."""
    with open(f"{marker}.tokens", "a") as fh:  # first: a pid in ``marker`` has its token listed
        fh.write(f"{self.idempotency_token}\n")
    with open(marker, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "token": self.idempotency_token, "pid": os.getpid(),
            "redelivered": bool((self.request.delivery_info or {}).get("redelivered"))}


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True)
def recovery_probe(self, marker, hold):
    """A plain task (the broker alone): appends ``<pid> <time.time()> <redelivered>`` to
    ``marker`` when it starts, then runs ``hold`` s. tests/integration/test_recovery.py and
    ``python -m bench.recovery`` time how long a SIGKILLed worker's message takes to come back."""
    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    with open(marker, "a") as fh:
        fh.write(f"{os.getpid()} {time.time():.3f} {int(redelivered)}\n")
    time.sleep(hold)
    return os.getpid()


@app.task(base=IdempotentTask, bind=True)
def summarize(self, results):
    """A chord body: keyed by its input, like any other IdempotentTask."""
    effect("summary")
    return sorted(r["order_id"] for r in results)


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",))
def manual_retry(self, order_id):
    """Calls ``self.retry()`` itself once; the retry must carry the same key."""
    effect(f"attempt:{order_id}", self.idempotency_key)
    effect(f"token:{order_id}", self.idempotency_token)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    effect(f"charge:{order_id}")
    return {"key": self.idempotency_key, "token": self.idempotency_token}


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",),
          idempotency_record_timeout=2)
def hold_then_charge(self, order_id, hold=30.0):
    """Holds until released (so a test can break the store), then charges."""
    effect(f"started:{order_id}", self.idempotency_token)
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}")
    return order_id


@app.task(base=IdempotentTask, bind=True, idempotency_fields=("order_id",), idempotency_wait=0.3,
          max_retries=0)
def impatient(self, order_id, hold=0.0):
    """Waits only 0.3 s for a busy key, and may not retry at all (max_retries=0)."""
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "ran_in": self.request.id}


# -- time limits (tests/integration/test_time_limits.py) ------------------------------------------
# One action, three tasks (one operation, so one key) with a 3 s limit from their options, the app
# settings or the call. The 5 s lease outlives a 3 s limit: a duplicate that waited it out would
# be failed by its own limit.
import signal as _signal  # noqa: E402

_LIMITED: dict[str, object] = {
    "base": IdempotentTask, "bind": True, "idempotency_operation": "limited",
    "idempotency_fields": ("order_id",), "idempotency_lease": 5,
    # These tests are about a delivered duplicate's wait under a time limit: every copy is
    # published (no attach at enqueue), and it waits in the worker.
    "idempotency_wait": 10, "idempotency_check_on_enqueue": False,
}


def _limited(self, order_id, marker, hold, die):  # type: ignore[no-untyped-def]
    with open(marker, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if die and _ledger.set(f"{PREFIX}died:{order_id}", 1, nx=True, ex=600):
        os.kill(os.getpid(), _signal.SIGKILL)  # once, right after the claim, before the effect
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{order_id}"):
        time.sleep(0.02)
    effect(f"charge:{order_id}", self.request.id)
    return {"order_id": order_id, "token": self.idempotency_token, "pid": os.getpid()}


@app.task(**_LIMITED)
def limited(self, order_id, marker, hold=0.0, die=False):
    """Limits from the app settings or the call. Writes its pid to ``marker``; ``die``
    SIGKILLs its own process once; then holds up to ``hold`` s (until released) and charges."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**_LIMITED, soft_time_limit=3)
def limited_soft(self, order_id, marker, hold=0.0, die=False):
    """``limited`` with the task option ``soft_time_limit=3``."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**_LIMITED, time_limit=3)
def limited_hard(self, order_id, marker, hold=0.0, die=False):
    """``limited`` with the task option ``time_limit=3``."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**{**_LIMITED, "idempotency_lease": 15}, time_limit=3)
def limited_hard_held(self, order_id, marker, hold=0.0, die=False):
    """``limited_hard`` with a 15 s lease: a body killed by its limit leaves its claim held for
    10-15 s (a third of the lease between renewals), time enough on a loaded machine for the pool
    to replace the child and a duplicate sent after the kill to find the claim still held."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**{**_LIMITED, "idempotency_operation": "limited_attach", "idempotency_wait": 0,
             "idempotency_check_on_enqueue": True}, time_limit=3)
def limited_attach(self, order_id, marker, hold=0.0, die=False):
    """``limited_hard`` whose copies attach at enqueue (tests/integration/test_attach_ended.py)."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**{**_LIMITED, "idempotency_operation": "revocable_attach", "idempotency_wait": 0,
             "idempotency_check_on_enqueue": True, "idempotency_lease": 30})
def revocable_attach(self, order_id, marker, hold=0.0, die=False):
    """``limited_attach`` without a time limit, whose claim outlives a terminated body for
    20-30 s (a third of the lease between renewals): on a loaded machine, the revoke, the
    REVOKED result and the copy's enqueue after it take longer than the 5 s lease's 3 s
    (tests/integration/test_attach_ended.py)."""
    return _limited(self, order_id, marker, hold, die)


@app.task(**{**_LIMITED, "idempotency_lease": 20}, soft_time_limit=3)
def limited_soft_redelivered(self, order_id, marker, hold=0.0, die=False):
    """``limited_soft`` with a 20 s lease: the pool notices a SIGKILLed child within about 5 s
    on an idle machine (far later on a loaded one) and the message comes back then, to a lease
    still fresh for longer than the limit."""
    return _limited(self, order_id, marker, hold, die)


# -- chaos suite (tests/chaos) -------------------------------------------------------------------
# Effects are committed to a PostgreSQL ledger (``IDEM_PG_URL``, tables ``<IDEM_PG_LEDGER>_*``):
#
# * ``_ledger``: one row per effect that took place;
# * ``_remote``: the idempotency keys a remote that honours keys has applied (primary key);
# * ``_calls``: every call a body made to the remote, applied or answered as a replay;
# * ``_kills``: which one-shot self-kills already happened (action, point).

import json as _json  # noqa: E402

if os.environ.get("IDEM_STORE_OPTIONS"):
    app.conf.idempotency_store_options = _json.loads(os.environ["IDEM_STORE_OPTIONS"])

_PG_URL = os.environ.get("IDEM_PG_URL", "")
_PG_TABLES = os.environ.get("IDEM_PG_LEDGER", "")
_pg_state: dict[str, object] = {}


def _pg():  # type: ignore[no-untyped-def]
    """This process's ledger connection (a new one after a fork: never share a socket)."""
    import psycopg

    conn = _pg_state.get("conn")
    if conn is None or _pg_state.get("pid") != os.getpid() or conn.closed or conn.broken:
        conn = psycopg.connect(_PG_URL, autocommit=True)
        _pg_state.update(conn=conn, pid=os.getpid())
    return conn


def kill_once(action: str, point: str) -> bool:
    """True the first time (across every process) ``action`` reaches ``point``; committed."""
    row = _pg().execute(
        f"INSERT INTO {_PG_TABLES}_kills (action, point) VALUES (%s, %s) "
        f"ON CONFLICT DO NOTHING RETURNING 1", (action, point),
    ).fetchone()
    return row is not None


def _die() -> None:
    os.kill(os.getpid(), _signal.SIGKILL)


def commit_effect(task, action: str, *, forward_key: bool, tag: str = "",  # type: ignore[no-untyped-def]
                  kill_before_commit: bool = False) -> bool:
    """Commit one effect to the PostgreSQL ledger in one transaction; True if it took place.

    With ``forward_key`` the write goes through a remote that honours idempotency keys: a key it
    has already applied is answered as a replay and adds no effect. ``kill_before_commit``
    SIGKILLs this process inside the open transaction (PostgreSQL rolls it back).
    """
    req = task.request
    meta = (action, task.idempotency_key, task.idempotency_token, req.id, req.retries or 0,
            os.getpid())
    conn = _pg()
    with conn.transaction():
        applied = True
        if forward_key:
            applied = conn.execute(
                f"INSERT INTO {_PG_TABLES}_remote (idem_key, action) VALUES (%s, %s) "
                f"ON CONFLICT DO NOTHING RETURNING 1", (task.idempotency_key, action),
            ).fetchone() is not None
        conn.execute(
            f"INSERT INTO {_PG_TABLES}_calls (action, idem_key, token, task_id, retries, pid, "
            f"applied, tag) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", (*meta, applied, tag),
        )
        if applied:
            conn.execute(
                f"INSERT INTO {_PG_TABLES}_ledger (action, idem_key, token, task_id, retries, pid) "
                f"VALUES (%s, %s, %s, %s, %s, %s)", meta,
            )
        if kill_before_commit:
            _die()
    return applied


class ChaosTask(IdempotentTask):
    """Test-only base: ``kill="after_record"`` SIGKILLs the worker child once, right after the
    gate recorded the outcome and before the result meta is stored or the message acknowledged.

    When the store cannot carry the result meta in the record's script, the task writes it right
    after the record (celery_idem/results_redis.py): the kill comes between the two. Once SUCCESS is
    stored, Celery's main process acknowledges a lost child's message instead of redelivering it,
    which is not the scenario these tests are after.
    """

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = super().__call__(*args, **kwargs)
        _kill_after_record(args, kwargs)  # results left to Celery: no write_result call
        return result


def _write_result_after_a_kill(writer, req, outcome):  # type: ignore[no-untyped-def]
    """celery_idem.delivery.write_result, after ChaosTask's ``kill="after_record"`` point."""
    if isinstance(app.tasks.get(getattr(req, "task", None) or ""), ChaosTask):
        _kill_after_record(req.args or (), req.kwargs or {})
    _write_result(writer, req, outcome)


# The seam writes the result through delivery.write_result once the gate recorded: the kill
# goes between the two (a test-only patch of this worker's module, like a debugger breakpoint).
_write_result = celery_idem.delivery.write_result
celery_idem.delivery.write_result = _write_result_after_a_kill


def _kill_after_record(args, kwargs):  # type: ignore[no-untyped-def]
    action = args[0] if args else kwargs.get("action")
    if kwargs.get("kill") == "after_record" and kill_once(str(action), "after_record"):
        _die()


def _chaos_body(self, action, hold, marker, forward_key, timeout, kill):  # type: ignore[no-untyped-def]
    if marker:
        with open(f"{marker}.tokens", "a") as fh:  # first: a pid in ``marker`` has its token listed
            fh.write(f"{self.idempotency_token}\n")
        with open(marker, "a") as fh:
            fh.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not flag(f"release:{action}"):
        time.sleep(0.01)
    first = (self.request.retries or 0) == 0
    if timeout == "before_commit" and first:
        raise TimeoutError(f"provider timed out before the commit of {action}")
    die_before = kill == "before_commit" and kill_once(action, kill)
    die_after = kill == "after_commit" and kill_once(action, kill)
    tag = "timeout_after" if timeout == "after_commit" and first else ""
    if die_after:
        tag = "kill_after_commit"
    applied = commit_effect(self, action, forward_key=forward_key, tag=tag,
                            kill_before_commit=die_before)
    if die_after:
        _die()
    if tag == "timeout_after":
        raise TimeoutError(f"the response to the commit of {action} was lost")
    return {"action": action, "token": self.idempotency_token, "pid": os.getpid(),
            "task_id": self.request.id, "retries": self.request.retries or 0, "applied": applied,
            "redelivered": bool((self.request.delivery_info or {}).get("redelivered"))}


@app.task(base=ChaosTask, bind=True, idempotency_fields=("action",), idempotency_lease=3,
          idempotency_wait=5, autoretry_for=(TimeoutError,), retry_backoff=False,
          default_retry_delay=0, max_retries=5)
def chaos_effect(self, action, hold=0.0, marker="", forward_key=False, timeout="", kill=""):
    """One effect per action, committed to the PostgreSQL ledger. Faults, each at most once per
    action: ``timeout`` (``before_commit``/``after_commit``, on the first attempt) and ``kill``
    (``before_commit``: inside the open transaction; ``after_commit``; ``after_record``)."""
    return _chaos_body(self, action, hold, marker, forward_key, timeout, kill)


@app.task(base=ChaosTask, bind=True, idempotency_fields=("action",), idempotency_lease=60,
          idempotency_wait=5)
def chaos_effect_long(self, action, hold=0.0, marker=""):
    """Like ``chaos_effect`` with a 60 s lease: no renewal happens during a short test."""
    return _chaos_body(self, action, hold, marker, False, "", "")


@app.task(base=ChaosTask, bind=True, idempotency_fields=("action",), idempotency_lease=2,
          idempotency_wait=3, idempotency_record_timeout=1)
def chaos_big_result(self, action, size):
    """Commits one effect, then returns ``size`` bytes of text (more than the store takes)."""
    commit_effect(self, action, forward_key=False)
    return "x" * size


@app.task(base=ChaosTask, bind=True, idempotency_fields=("action",), idempotency_lease=2,
          idempotency_wait=3, autoretry_for=(TimeoutError,), retry_backoff=False,
          default_retry_delay=0, max_retries=5)
def soak_effect(self, action, hold=0.0, timeout="", kill=""):
    """The soak's task: every effect goes through the remote that honours keys."""
    return _chaos_body(self, action, hold, "", True, timeout, kill)


@app.task(base=ChaosTask, bind=True, idempotency_validate=True, idempotency_lease=3)
def chaos_echo(self, action, blob="", secret=""):
    """Keyed by every argument (and validated): commits one effect, returns only sizes."""
    commit_effect(self, action, forward_key=False)
    return {"action": action, "blob": len(blob), "secret": len(secret)}


# -- Redis Cluster / Sentinel failover (tests/redis_ha) --------------------------------------------
# ``IDEM_CONF``: JSON of more app settings (a sentinel backend's transport options, ...).

if os.environ.get("IDEM_CONF"):
    app.conf.update(_json.loads(os.environ["IDEM_CONF"]))


@app.task(base=ChaosTask, bind=True, idempotency_fields=("action",), idempotency_lease=30,
          idempotency_wait=3, idempotency_record_timeout=60)
def ha_effect(self, action, hold=0.0):
    """One effect per action; lease and record timeout longer than a failover (a few seconds),
    so a holder cut off by the failover keeps its claim and records once the shard is back."""
    return _chaos_body(self, action, hold, "", False, "", "")


# -- calls that do not bind, and Task.replace (tests/integration/test_replace.py) ----------------


@app.task(base=IdempotentTask, bind=True, typing=False)
def not_typed(self, x, y):
    """``typing=False``: a call that does not bind is sent, and fails in the worker."""
    effect("not_typed")
    return x + y


@app.task(base=IdempotentTask, bind=True)
def replaced(self, name, state=False):
    """Replaced by a chain of an ``add_step`` and itself with ``state=True``, which returns."""
    effect(f"replaced:{name}:{'out' if state else 'in'}")
    if state:
        return f"{name}:done"
    raise self.replace(add_step.si(0, f"{name}-step") | replaced.si(name, state=True))
