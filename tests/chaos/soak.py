"""Soak: thousands of actions, duplicated and faulted at random; nothing run twice, nothing lost.

    python -m tests.chaos.soak --actions 2000 [--store redis|sql] [--seed N] [--json]

Starts a private ``redis-server`` (broker and result backend), the store (a second private
``redis-server``, or a PostgreSQL table of its own) behind a :class:`TcpProxy` that drops
connections at random, two prefork workers, and a PostgreSQL ledger. Then:

* every action is enqueued 1 to 4 times, the copies spread over 1.5 s (some meet the running
  holder, some the done record at enqueue, some race it at a worker);
* every action draws one fault: none, a TimeoutError before or after its commit to the remote
  (autoretry), a SIGKILL of its worker child inside the open transaction, right after the
  commit, or right after the record; on top, a random worker child is SIGKILLed every few
  seconds, and the proxy cuts a fraction of the store's requests (before they reach the
  server, or after, losing the reply);
* every body commits its effect through a remote that honours the forwarded key (the ledger
  gets a row only for a key it has not applied; every call is logged in ``_calls``).

Figures, once every copy has a terminal state and the queue is empty:

``actions``
    actions enqueued;
``effects``
    effects in the ledger;
``duplicates``
    actions with more than one effect, plus actions whose body reached the remote again
    without an injected fault that explains it (a remote that ignores keys would have counted a
    second effect). A replay is explained only when it ran under a newer claim (a higher token,
    or the retry's hand-over) and the call before it lost its response (TimeoutError after the
    commit), or was SIGKILLed right after its commit, or its process was SIGKILLed at random
    between the two calls;
``lost``
    actions with no effect that did not fail terminally;
``unresolved``
    copies whose result never reached a terminal state (a caller would wait forever);
``failed``
    actions whose every copy failed (none is expected: every fault is transient).

Exits 1 when any of duplicates, lost, unresolved or failed is not zero.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tests.chaos.support import ChaosRedis, Ledger, Stack, TcpProxy, libpq_url, reset_app
from tests.conftest import PG_URL

#: (fault, weight, soak_effect keyword arguments)
FAULTS: tuple[tuple[str, int, dict[str, str]], ...] = (
    ("none", 46, {}),
    ("timeout_before_commit", 12, {"timeout": "before_commit"}),
    ("timeout_after_commit", 12, {"timeout": "after_commit"}),
    ("kill_before_commit", 10, {"kill": "before_commit"}),
    ("kill_after_commit", 10, {"kill": "after_commit"}),
    ("kill_after_record", 10, {"kill": "after_record"}),
)
HOLDS = (0.0, 0.0, 0.0, 0.01, 0.05, 0.2)
TERMINAL = {"SUCCESS", "FAILURE", "REVOKED"}


@dataclass
class Config:
    actions: int = 300
    store: str = "redis"
    seed: int | None = None
    workers: int = 2
    concurrency: int = 2
    max_copies: int = 4
    rate: float = 25.0  # actions enqueued per second
    spread: float = 1.5  # seconds over which an action's copies are enqueued
    kill_every: float = 3.0  # mean seconds between random SIGKILLs of a worker child
    drop_rate: float = 0.004  # fraction of store requests the proxy cuts
    timeout: float = 900.0


@dataclass
class Copy:
    action: str
    task_id: str = ""
    state: str = ""
    cached: bool = False  # answered by the enqueue check, nothing published
    error: str = ""


@dataclass
class Report:
    actions: int = 0
    effects: int = 0
    duplicates: int = 0
    lost: int = 0
    unresolved: int = 0
    failed: int = 0
    copies: int = 0
    answered_at_enqueue: int = 0
    body_calls: int = 0
    replays_by_fault: int = 0
    replays_by_random_kill: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    random_kills: int = 0
    store_drops: dict[str, int] = field(default_factory=dict)
    elapsed: float = 0.0
    store: str = ""
    seed: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.lost or self.unresolved or self.failed)


class Killer(threading.Thread):
    """SIGKILLs a random child of a random worker every ``mean`` seconds on average."""

    def __init__(self, stack: Stack, mean: float, rng: random.Random) -> None:
        super().__init__(daemon=True, name="soak-killer")
        self.stack, self.mean, self.rng = stack, mean, rng
        #: (pid, time before the kill, time after it): on a loaded machine this thread can be
        #: descheduled on either side of ``os.kill``, so the kill is known only within the two.
        self.kills: list[tuple[int, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.rng.expovariate(1 / self.mean)):
            worker = self.rng.choice(self.stack.workers)
            children = worker.children()
            if not children:
                continue
            pid = self.rng.choice(children)
            before = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append((pid, before, time.time()))


def build(cfg: Config) -> tuple[Stack, list[Any]]:
    """The stack: broker, proxied store, ledger, workers. Returns it and what to clean up."""
    pg = libpq_url(PG_URL)
    broker = ChaosRedis()
    cleanup: list[Any] = [broker]
    ledger = Ledger(pg, f"soak_{os.getpid()}_{int(time.time())}")
    cleanup.append(ledger)
    if cfg.store == "redis":
        server = ChaosRedis("--appendonly", "yes", "--appendfsync", "everysec")
        cleanup.append(server)
        proxy = TcpProxy(server.port, seed=cfg.seed or 0)
        stack = Stack(broker, proxy.url, ledger, name="redis")
    else:
        where = urlsplit(PG_URL)
        proxy = TcpProxy(where.port or 5432, where.hostname or "127.0.0.1", seed=cfg.seed or 0)
        table = f"{ledger.base}_records"
        auth = where.netloc.rsplit("@", 1)[0] + "@" if "@" in where.netloc else ""
        url = f"db+postgresql+psycopg://{auth}127.0.0.1:{proxy.port}{where.path}"
        stack = Stack(broker, url, ledger, name="sql", store_options={"table_name": table})
        cleanup.append(("table", table))
    cleanup.append(proxy)
    stack.proxy = proxy  # type: ignore[attr-defined]
    return stack, cleanup


def schedule(cfg: Config, rng: random.Random, run: str) -> tuple[list[tuple[float, str, dict[str, Any]]],
                                                                  dict[str, str]]:
    """(time, action, kwargs) for every copy, sorted by time, and each action's fault."""
    events: list[tuple[float, str, dict[str, Any]]] = []
    faults: dict[str, str] = {}
    names, weights = [f[0] for f in FAULTS], [f[1] for f in FAULTS]
    kwargs_of = {f[0]: f[2] for f in FAULTS}
    for i in range(cfg.actions):
        action = f"{run}-{i}"
        fault = rng.choices(names, weights)[0]
        faults[action] = fault
        kwargs = {"hold": rng.choice(HOLDS), **kwargs_of[fault]}
        at = i / cfg.rate
        events.append((at, action, kwargs))
        for _ in range(rng.randint(1, cfg.max_copies) - 1):
            events.append((at + rng.uniform(0, cfg.spread), action, kwargs))
    events.sort(key=lambda e: e[0])
    return events, faults


def enqueue_all(events: list[tuple[float, str, dict[str, Any]]], copies: list[Copy],
                deadline: float) -> None:
    from celery_idem import CachedResult
    from tests.integration import app as tasks

    start = time.monotonic()
    for at, action, kwargs in events:
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the producer, not synchronisation
        copy = Copy(action)
        for attempt in range(10):
            try:
                r = tasks.soak_effect.apply_async((action,), kwargs)
            except Exception as exc:  # the broker is not faulted; report, retry a little
                copy.error = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1 * (attempt + 1))
                continue
            copy.task_id, copy.error = r.id, ""
            if isinstance(r, CachedResult):
                copy.state, copy.cached = r.state, True
            break
        copies.append(copy)


def poll_states(stack: Stack, copies: list[Copy]) -> int:
    """Fill in terminal states from the result backend; return how many copies are pending."""
    pending = [c for c in copies if c.task_id and c.state not in TERMINAL]
    for i in range(0, len(pending), 500):
        batch = pending[i:i + 500]
        raw = stack.flags.mget([f"celery-task-meta-{c.task_id}" for c in batch])
        for copy, value in zip(batch, raw, strict=True):
            if value:
                copy.state = json.loads(value).get("status", "")
    return sum(1 for c in copies if not c.task_id or c.state not in TERMINAL)


def analyse(stack: Stack, copies: list[Copy], faults: dict[str, str], killer: Killer,
            report: Report) -> None:
    effects = collections.Counter(
        r["action"] for r in stack.ledger._rows(f"SELECT action FROM {stack.ledger.base}_ledger"))
    calls_by_action: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    calls = stack.ledger.all_calls()
    for call in calls:
        calls_by_action[call["action"]].append(call)
    kills_by_pid: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for pid, start, end in killer.kills:
        kills_by_pid[pid].append((start, end))
    states: dict[str, list[str]] = collections.defaultdict(list)
    for copy in copies:
        states[copy.action].append(copy.state if copy.task_id else "NOT_SENT")

    report.actions = len(faults)
    report.effects = sum(effects.values())
    report.copies = len(copies)
    report.answered_at_enqueue = sum(1 for c in copies if c.cached)
    report.body_calls = len(calls)
    report.faults = dict(collections.Counter(faults.values()))
    report.random_kills = len(killer.kills)
    report.store_drops = dict(stack.proxy.drops)  # type: ignore[attr-defined]

    def killed_between(before: dict[str, Any], call: dict[str, Any]) -> bool:
        # The kill fell somewhere in [start, end]: it explains the replay when that span
        # meets the span between the two calls.
        return any(start <= call["at"] and before["at"] - 0.01 <= end
                   for start, end in kills_by_pid.get(before["pid"], ()))

    for action in faults:
        n = effects.get(action, 0)
        bad_replays = 0
        history = calls_by_action.get(action, [])
        for before, call in itertools.pairwise(history):
            if call["applied"]:
                continue
            # A replay needs a new claim (a higher token, or the retry's hand-over) ...
            fenced = call["token"] > before["token"] or call["retries"] > before["retries"]
            # ... and a reason: the call before it lost its response, or its process died
            if fenced and before["tag"] in ("timeout_after", "kill_after_commit"):
                report.replays_by_fault += 1
            elif fenced and killed_between(before, call):
                report.replays_by_random_kill += 1
            else:
                bad_replays += 1
        if n > 1 or bad_replays:
            report.duplicates += 1
            report.details.append(f"duplicate {action} fault={faults[action]} effects={n} "
                                  f"unexplained_replays={bad_replays} calls={_brief(history)}")
        action_states = states[action]
        all_failed = all(s == "FAILURE" for s in action_states)
        if n == 0 and not all_failed:
            report.lost += 1
            report.details.append(f"lost {action} fault={faults[action]} states={action_states}")
        if all_failed:
            report.failed += 1
            report.details.append(f"failed {action} fault={faults[action]}")
    report.unresolved = sum(1 for c in copies if not c.task_id or c.state not in TERMINAL)
    for copy in copies:
        if not copy.task_id or copy.state not in TERMINAL:
            report.details.append(f"unresolved {copy.action} task={copy.task_id} "
                                  f"state={copy.state or 'PENDING'} {copy.error}")


def _brief(calls: list[dict[str, Any]]) -> str:
    return ", ".join(f"(t{c['token']} r{c['retries']} pid{c['pid']} applied={c['applied']} "
                     f"tag={c['tag']} at={c['at']:.3f})" for c in calls)


def run(cfg: Config, log: Any = sys.stderr) -> Report:
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    report = Report(store=cfg.store, seed=seed)
    started = time.monotonic()
    deadline = started + cfg.timeout
    stack, cleanup = build(cfg)
    killer = Killer(stack, cfg.kill_every, random.Random(seed + 1))
    keep_logs = False
    try:
        stack.activate()
        for i in range(cfg.workers):
            stack.worker(f"soak{i}", concurrency=cfg.concurrency)
        stack.proxy.drop_rate = cfg.drop_rate  # type: ignore[attr-defined]
        events, faults = schedule(cfg, rng, f"soak{seed}")
        print(f"soak: store={cfg.store} actions={cfg.actions} copies={len(events)} seed={seed} "
              f"workers={cfg.workers}x{cfg.concurrency}", file=log, flush=True)
        killer.start()
        copies: list[Copy] = []
        producer = threading.Thread(target=enqueue_all, args=(events, copies, deadline),
                                    daemon=True)
        producer.start()
        last = 0.0
        while True:
            pending = poll_states(stack, copies)
            if not producer.is_alive() and pending == 0:
                break
            if time.monotonic() > deadline:
                print("soak: deadline reached", file=log, flush=True)
                break
            if time.monotonic() - last > 10:
                last = time.monotonic()
                print(f"soak: {len(copies) - pending}/{len(events)} copies resolved, "
                      f"{int(last - started)} s", file=log, flush=True)
            time.sleep(0.25)
        killer.stop.set()
        producer.join(5)
        # Every copy is answered; let what is still queued (re-queues, redeliveries) finish
        drain = time.monotonic() + min(120.0, max(5.0, deadline - time.monotonic()))
        while not stack.queue_empty() and time.monotonic() < drain:
            time.sleep(0.25)
        stack.proxy.drop_rate = 0.0  # type: ignore[attr-defined]
        # A copy re-queued with a countdown (at most BUSY_MAX, 5 s) is held by a worker, not in
        # the queue: give the states the time of two such countdowns to settle.
        settle = max(drain, time.monotonic() + 10.0)
        while poll_states(stack, copies) and time.monotonic() < settle:
            time.sleep(0.25)
        analyse(stack, copies, faults, killer, report)
        report.elapsed = round(time.monotonic() - started, 1)
        keep_logs = not report.ok
        return report
    finally:
        killer.stop.set()
        stack.deactivate()
        logs = [w.log for w in stack.workers]
        stack.close()
        reset_app(stack.app)
        for item in reversed(cleanup):
            if isinstance(item, tuple):
                stack.ledger.conn.execute(f"DROP TABLE IF EXISTS {item[1]}")
            elif isinstance(item, Ledger):
                item.drop()
            elif isinstance(item, ChaosRedis):
                item.cleanup()
            else:
                item.close()
        for path in logs:
            if keep_logs:
                print(f"soak: worker log kept at {path}", file=log)
            else:
                path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    parser.add_argument("--actions", type=int, default=defaults.actions)
    parser.add_argument("--store", choices=("redis", "sql"), default=defaults.store)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--rate", type=float, default=defaults.rate,
                        help="actions enqueued per second")
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every,
                        help="mean seconds between random SIGKILLs of a worker child")
    parser.add_argument("--drop-rate", type=float, default=defaults.drop_rate,
                        help="fraction of store requests whose connection is cut")
    parser.add_argument("--timeout", type=float, default=defaults.timeout)
    parser.add_argument("--json", action="store_true", help="also print the report as JSON")
    args = parser.parse_args(argv)
    cfg = Config(actions=args.actions, store=args.store, seed=args.seed, workers=args.workers,
                 concurrency=args.concurrency, rate=args.rate, kill_every=args.kill_every,
                 drop_rate=args.drop_rate, timeout=args.timeout)
    report = run(cfg)
    for line in report.details[:50]:
        print(f"  {line}")
    print(f"store {report.store}, seed {report.seed}, {report.elapsed} s, {report.copies} copies "
          f"({report.answered_at_enqueue} answered at enqueue), {report.body_calls} body calls, "
          f"replays absorbed by the remote's key check: {report.replays_by_fault} after an "
          f"injected lost response or post-commit kill, {report.replays_by_random_kill} after a "
          f"random SIGKILL")
    print("faults: " + ", ".join(f"{k}={v}" for k, v in sorted(report.faults.items()))
          + f"; random SIGKILLs={report.random_kills}; store cuts: "
          + ", ".join(f"{k}={v}" for k, v in report.store_drops.items()))
    print(f"actions {report.actions}")
    print(f"effects {report.effects}")
    print(f"duplicates {report.duplicates}")
    print(f"lost {report.lost}")
    print(f"unresolved {report.unresolved}, failed {report.failed}")
    if args.json:
        doc = asdict(report)
        doc["details"] = doc["details"][:50]
        print(json.dumps(doc))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
