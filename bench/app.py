"""The Celery app of the benchmark, built from :class:`Settings` (the producer and the workers
build the same app; workers read the settings from ``BENCH_SETTINGS``, see ``worker_app``).

Tasks (all return their ``action`` argument, a short string):

==================  ====================================================================
bench.plain         plain ``@app.task`` no-op (Celery defaults: acks early)
bench.plain_late    the same with ``acks_late=True, reject_on_worker_lost=True`` (what
                    ``IdempotentTask`` sets), to separate the ack mode from the gate
bench.idem          the same no-op with ``base=IdempotentTask``, keyed by ``action``
bench.plain_count   plain task whose body does ``INCR counter`` (counts bodies run)
bench.idem_count    ``IdempotentTask`` version of it, keyed by ``action`` only
bench.idem_intent   ``bench.idem`` with ``idempotency_intent=True`` (and ``_count``)
bench.<name>_io     every unique task above and below again, its body sleeping ``IO_SECONDS``
                    first (a stand-in for an HTTP call: the realistic row)
bench.once[_count]  the peers (``bench/requirements.txt``; each only when it imports):
bench.singleton...  celery_once ``QueueOnce`` (graceful), celery-singleton ``Singleton``,
bench.powertools..  and a plain task calling Powertools' ``idempotent_function`` (Redis layer)
==================  ====================================================================

Every peer keeps its keys under the run's prefix (celery_once's ``qo_<task>_<args>`` keys carry
it in the action), so the run's cleanup removes them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.config import settings
from celery_idem.enqueue_redis import WithinPublish

ENV = "BENCH_SETTINGS"

#: The I/O a realistic body waits for (the ``_io`` tasks): a sleep standing in for an HTTP call.
IO_SECONDS = 0.010


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration (one queue, one store)."""

    prefix: str
    queue: str
    redis_url: str
    store_url: str | None = None  # None: the store is derived from result_backend (Redis)
    store_options: dict[str, Any] = field(default_factory=dict)
    # False: the app setting ``idempotency_accelerate = False`` (producer and worker), so this
    # system runs the plain paths while the others in the same process keep the accelerations.
    accelerate: bool = True

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> Settings:
        try:
            raw = os.environ[ENV]
        except KeyError:
            raise SystemExit(f"bench.worker_app needs {ENV} (it is started by `python -m bench`)") from None
        return cls(**json.loads(raw))

    @property
    def ready_key(self) -> str:
        return f"{self.prefix}ready:{self.queue}"


class _AskStore(WithinPublish):
    """The enqueue check without the memory of this process's own recent messages."""

    RECENT = 0.0


_clients: dict[tuple[int, str], redis.Redis] = {}


def _counter_client(url: str) -> redis.Redis:
    """One client per process (a forked pool child builds its own)."""
    key = (os.getpid(), url)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = redis.Redis.from_url(url)
    return client


def build_app(s: Settings) -> Celery:
    app = Celery(f"bench-{s.queue}", broker=s.redis_url, backend=s.redis_url, set_as_current=False)
    app.conf.update(
        task_default_queue=s.queue,
        # Every broker and result key under the run's prefix: nothing shared, all cleaned up.
        broker_transport_options={"global_keyprefix": s.prefix},
        result_backend_transport_options={"global_keyprefix": s.prefix},
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        idempotency_key_prefix=s.prefix + "idem:",
    )
    if s.store_url:
        app.conf.idempotency_store = s.store_url
    if s.store_options:
        app.conf.idempotency_store_options = dict(s.store_options)
    if not s.accelerate:
        app.conf.idempotency_accelerate = False
    redis_url = s.redis_url
    # shared=False: a shared task would be added to every app built later in this process.

    @app.task(shared=False, name="bench.plain")
    def plain(action: str) -> str:
        return action

    @app.task(shared=False, name="bench.plain_late", acks_late=True, reject_on_worker_lost=True)
    def plain_late(action: str) -> str:
        return action

    @app.task(shared=False, name="bench.idem", base=IdempotentTask, idempotency_fields=("action",))
    def idem(action: str) -> str:
        return action

    @app.task(shared=False, name="bench.plain_count")
    def plain_count(action: str, counter: str) -> str:
        _counter_client(redis_url).incr(counter)
        return action

    @app.task(shared=False, name="bench.idem_count", base=IdempotentTask, idempotency_fields=("action",))
    def idem_count(action: str, counter: str) -> str:
        _counter_client(redis_url).incr(counter)
        return action

    # The same with the producer-side done-check off (one store round trip less per enqueue;
    # a done key's enqueue publishes and the worker answers it from the record).
    @app.task(shared=False, name="bench.idem_nocheck", base=IdempotentTask, idempotency_fields=("action",),
              idempotency_check_on_enqueue=False)
    def idem_nocheck(action: str) -> str:
        return action

    @app.task(shared=False, name="bench.idem_nocheck_count", base=IdempotentTask,
              idempotency_fields=("action",), idempotency_check_on_enqueue=False)
    def idem_nocheck_count(action: str, counter: str) -> str:
        _counter_client(redis_url).incr(counter)
        return action

    # The same with ``idempotency_intent=True``: the message is kept in the store until its
    # outcome (bench/intents.py, and the "(intents)" systems of the end-to-end run).
    @app.task(shared=False, name="bench.idem_intent", base=IdempotentTask, idempotency_fields=("action",),
              idempotency_intent=True)
    def idem_intent(action: str) -> str:
        return action

    @app.task(shared=False, name="bench.idem_intent_count", base=IdempotentTask,
              idempotency_fields=("action",), idempotency_intent=True)
    def idem_intent_count(action: str, counter: str) -> str:
        _counter_client(redis_url).incr(counter)
        return action

    # The same as idem_count, but its copies always ask the store (no attach without a round
    # trip for copies of this process's own recent messages).
    @app.task(shared=False, name="bench.idem_askstore_count", base=IdempotentTask,
              idempotency_fields=("action",))
    def idem_askstore_count(action: str, counter: str) -> str:
        _counter_client(redis_url).incr(counter)
        return action

    if settings(app).accelerate:  # with accelerations off there is no enqueue check to swap
        idem_askstore_count.__dict__["_enqueue_check"] = _AskStore()

    @app.task(shared=False, name="bench.plain_io")
    def plain_io(action: str) -> str:
        time.sleep(IO_SECONDS)
        return action

    @app.task(shared=False, name="bench.plain_late_io", acks_late=True, reject_on_worker_lost=True)
    def plain_late_io(action: str) -> str:
        time.sleep(IO_SECONDS)
        return action

    @app.task(shared=False, name="bench.idem_io", base=IdempotentTask, idempotency_fields=("action",))
    def idem_io(action: str) -> str:
        time.sleep(IO_SECONDS)
        return action

    @app.task(shared=False, name="bench.idem_nocheck_io", base=IdempotentTask,
              idempotency_fields=("action",), idempotency_check_on_enqueue=False)
    def idem_nocheck_io(action: str) -> str:
        time.sleep(IO_SECONDS)
        return action

    # In-flight copies (bench/inflight.py): a body that runs ``seconds`` (or until its flag is
    # set), with the default path, with the enqueue check off, and waiting in the
    # worker emulated (check off, and each delivered copy waiting up to 10 s in its pool process).
    def hold(action: str, seconds: float) -> str:
        client = _counter_client(redis_url)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not client.exists(f"{action}:release"):
            time.sleep(0.02)
        return action

    app.task(shared=False, name="bench.hold", base=IdempotentTask,
             idempotency_fields=("action",))(hold)
    app.task(shared=False, name="bench.hold_nocheck", base=IdempotentTask,
             idempotency_fields=("action",), idempotency_check_on_enqueue=False)(hold)
    app.task(shared=False, name="bench.hold_oldpath", base=IdempotentTask,
             idempotency_fields=("action",), idempotency_check_on_enqueue=False,
             idempotency_wait=10)(hold)

    _peer_tasks(app, s)
    return app


#: Peer name -> why it is unavailable (import error); filled by ``peer_status``.
def peer_status() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, mod in (("celery_once", "celery_once"), ("celery-singleton", "celery_singleton"),
                      ("powertools", "aws_lambda_powertools.utilities.idempotency.persistence.redis")):
        try:
            __import__(mod)
            if name == "powertools":
                __import__("aws_lambda_powertools.utilities.idempotency")
            out[name] = None
        except Exception as exc:  # an optional extra of the bench: report and skip
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _peer_tasks(app: Celery, s: Settings) -> None:
    import warnings

    # Powertools warns on every call outside Lambda (no remaining-time context): not our concern.
    warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
    status = peer_status()
    redis_url = s.redis_url
    if status["celery_once"] is None:
        from celery_once import QueueOnce  # type: ignore[import-untyped]

        # Lock while queued or running (released after the body); graceful: a duplicate enqueue
        # returns None instead of raising AlreadyQueued.
        app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                         "settings": {"url": redis_url, "default_timeout": 3600}}

        @app.task(shared=False, name="bench.once", base=QueueOnce, once={"graceful": True})
        def once(action: str) -> str:
            return action

        @app.task(shared=False, name="bench.once_io", base=QueueOnce, once={"graceful": True})
        def once_io(action: str) -> str:
            time.sleep(IO_SECONDS)
            return action

        @app.task(shared=False, name="bench.once_count", base=QueueOnce,
                  once={"graceful": True, "keys": ["action"]})
        def once_count(action: str, counter: str) -> str:
            _counter_client(redis_url).incr(counter)
            return action

    if status["celery-singleton"] is None:
        from celery_singleton import Singleton  # type: ignore[import-untyped]

        app.conf.singleton_backend_url = redis_url
        app.conf.singleton_key_prefix = s.prefix + "singleton:"

        @app.task(shared=False, name="bench.singleton", base=Singleton)
        def singleton(action: str) -> str:
            return action

        @app.task(shared=False, name="bench.singleton_io", base=Singleton)
        def singleton_io(action: str) -> str:
            time.sleep(IO_SECONDS)
            return action

        @app.task(shared=False, name="bench.singleton_count", base=Singleton, unique_on=["action"])
        def singleton_count(action: str, counter: str) -> str:
            _counter_client(redis_url).incr(counter)
            return action

    if status["powertools"] is None:
        from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer

        layer = RedisCachePersistenceLayer(client=redis.Redis.from_url(redis_url))  # type: ignore[arg-type]
        config = IdempotencyConfig(expires_after_seconds=3600)

        @idempotent_function(data_keyword_argument="action", persistence_store=layer, config=config,
                             key_prefix=s.prefix + "pt:noop")
        def pt_noop(action: str) -> str:
            return action

        @idempotent_function(data_keyword_argument="action", persistence_store=layer, config=config,
                             key_prefix=s.prefix + "pt:count")
        def pt_count(action: str, counter: str) -> str:
            _counter_client(redis_url).incr(counter)
            return action

        @app.task(shared=False, name="bench.powertools")
        def powertools(action: str) -> str:
            return pt_noop(action=action)  # type: ignore[no-any-return]

        @idempotent_function(data_keyword_argument="action", persistence_store=layer, config=config,
                             key_prefix=s.prefix + "pt:io")
        def pt_io(action: str) -> str:
            time.sleep(IO_SECONDS)
            return action

        @app.task(shared=False, name="bench.powertools_io")
        def powertools_io(action: str) -> str:
            return pt_io(action=action)  # type: ignore[no-any-return]

        @app.task(shared=False, name="bench.powertools_count")
        def powertools_count(action: str, counter: str) -> str:
            return pt_count(action=action, counter=counter)  # type: ignore[no-any-return]
