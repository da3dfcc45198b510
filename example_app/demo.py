"""The one-command demo: naive vs idempotent write tools, side by side, under real faults.

    python -m example_app.demo                      # embedded: SQLite files, no server
    python -m example_app.demo --broker redis://127.0.0.1:6379/0 \\
        --backend db+postgresql+psycopg://root@127.0.0.1:5432/test

It starts the provider (a separate HTTP process) and a ``celery worker`` process, runs every
scenario's agent conversation twice (naive tools, idempotent tools, each on its own order),
then counts the effects in the *provider's* database and prints one table. Exit code 0 only
if the idempotent column shows exactly one effect per action in every row not marked as a
limit, and the naive column shows the duplicate (so the fault really happened).

Settings come from the flags, else from the environment variables of
:data:`example_app.celery_app.ENV`, else from a fresh temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .payments import ProviderClient

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("naive", "idempotent")
TOOLS = ("charge_card", "create_shipment", "send_email")


@dataclass(frozen=True)
class Scenario:
    """One row of the table.

    Attributes:
        tag: Row label.
        title: Short title for the table.
        story: What happens, in one sentence.
        keys: Whether the provider honours ``Idempotency-Key`` for this row's orders.
        faults: ``(resource, fault, count, seconds)`` rules set on the provider.
        turns: Agent turns that handle the same request at the same time.
        crash_after: The agent process is SIGKILLed right after enqueueing this tool, then
            restarted from its checkpoint.
        timeouts: ``(tool, seconds)``: the agent's budget for the first call of a tool.
        defence: What keeps the idempotent tools at one effect here.
        limit: Why the idempotent column may show more than one here (not a pass criterion).
    """

    tag: str
    title: str
    story: str
    keys: bool
    faults: tuple[tuple[str, str, int, float], ...] = ()
    turns: int = 1
    crash_after: str | None = None
    timeouts: tuple[tuple[str, float], ...] = ()
    defence: str = "gate"
    limit: str | None = None


SCENARIOS = (
    Scenario("1", "agent re-calls a 'failed' tool",
             "charge_card answers after 1 s; the agent's 0.5 s budget runs out, the model sees "
             "an error (naive) or 'in progress, safe to call again' (idempotent) and calls "
             "charge_card again", keys=False,
             faults=(("charges", "slow", 1, 1.0),), timeouts=(("charge_card", 0.5),)),
    Scenario("2a", "timeout after commit + retries",
             "the provider commits the charge, then hangs up without answering, twice: the "
             "HTTP client's retry and then Celery's autoretry send it again", keys=True,
             faults=(("charges", "drop", 2, 0.0),), defence="key"),
    Scenario("2b", "timeout after commit + retries",
             "the same, with answers that come after the client's 1.5 s timeout, and a "
             "provider that ignores Idempotency-Key", keys=False,
             faults=(("charges", "delay", 2, 2.0),), defence="-",
             limit="the provider ignores Idempotency-Key. Each timed-out call may have charged, "
                   "and only the provider can tell: IdempotentTask releases its claim on "
                   "TimeoutError so the retry can run, and the HTTP client's own retry happens "
                   "inside one execution anyway. Row 2a is the fix: a provider that honours the "
                   "key the tool forwards."),
    Scenario("3", "two agent turns, same request",
             "two agent turns work on the same order at the same time (the user sent the "
             "message twice): every tool call is enqueued twice", keys=False, turns=2),
    Scenario("4", "agent crash, checkpoint resume",
             "the agent process is SIGKILLed right after it enqueued create_shipment; a new "
             "process resumes from the checkpoint and issues that call again",
             keys=False, crash_after="create_shipment"),
    Scenario("5", "e-mail + shipping API timeouts",
             "the e-mail API hangs up after sending, twice; the shipping API answers after "
             "the client's timeout, twice (both honour keys)", keys=True,
             faults=(("emails", "drop", 2, 0.0), ("shipments", "delay", 2, 2.0)), defence="key"),
)


@dataclass
class Run:
    """One conversation set (scenario x variant) and what it left behind."""

    scenario: Scenario
    variant: str
    order_id: str
    states: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    counts: tuple[int, int, int] = (0, 0, 0)  # charges per order, emails per recipient, shipments
    events: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stop(proc: subprocess.Popen[Any], grace: float = 15.0) -> None:
    """SIGTERM the process (a worker does a warm shutdown), then SIGKILL its group if needed.

    The pipes this side holds to it are closed too, rather than left to the garbage collector.
    """
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    finally:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def start_provider(db: str, table_prefix: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m example_app.payments serve`` on a free loopback port; return its URL."""
    with log.open("w") as err:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "example_app.payments", "serve", "--host", "127.0.0.1",
             "--port", "0", "--db", db, "--table-prefix", table_prefix],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 30
    while not sel.select(timeout=0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"the provider did not start:\n{log.read_text()[-2000:]}")
    url = proc.stdout.readline().split()[-1]
    wait_for(ProviderClient(url, timeout=1, retries=0).health, 20, "the provider to answer")
    return proc, url


def start_worker(run_id: str, pool: str, concurrency: int, log: Path) -> subprocess.Popen[bytes]:
    """Start ``celery worker`` for the example app (settings from the environment)."""
    cmd = [sys.executable, "-m", "celery", "-A", "example_app.celery_app", "worker",
           "-P", pool, "-c", str(concurrency), "-n", f"demo-{run_id}@%h", "-l", "INFO",
           "--without-gossip", "--without-mingle", "--without-heartbeat"]
    with log.open("w") as fh:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{log.read_text()[-3000:]}")
        return " ready." in log.read_text(errors="replace")

    try:
        wait_for(ready, 60, "the worker to be ready")
    except BaseException:
        stop(proc)
        raise
    return proc


def check_worker(queue: str | None, timeout: float = 15.0) -> None:
    """Fail fast when no worker consumes the queue (``--no-worker``)."""
    from celery.exceptions import TimeoutError as ResultTimeout

    from .tasks import ping

    try:
        ping.delay().get(timeout=timeout, interval=0.1)
    except ResultTimeout:
        raise RuntimeError(f"no worker answered on queue {queue or 'example'!r} within "
                           f"{timeout:g} s (start one, or drop --no-worker)") from None


# --------------------------------------------------------------------------------------------
# one scenario
# --------------------------------------------------------------------------------------------


class Demo:
    """Runs the scenarios against one provider and one set of workers, and counts the effects."""

    def __init__(self, args: argparse.Namespace, tmp: Path, run_id: str, provider_url: str,
                 event_log: Path | None) -> None:
        self.args = args
        self.tmp = tmp
        self.run_id = run_id
        self.provider = ProviderClient(provider_url, timeout=5, retries=0)
        self.event_log = event_log
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        if not self.args.quiet:
            with self.lock:
                print(text, flush=True)

    def order_id(self, scenario: Scenario, variant: str) -> str:
        return f"ord_{self.run_id}_{scenario.tag}{variant[0]}"

    def run_one(self, scenario: Scenario, variant: str) -> Run:
        run = Run(scenario, variant, self.order_id(scenario, variant))
        start = time.monotonic()
        try:
            for resource in ("charges", "emails", "shipments"):
                self.provider.add_rule(run.order_id, resource, keys=scenario.keys)
            for resource, fault, count, seconds in scenario.faults:
                self.provider.add_rule(run.order_id, resource, fault, count, seconds,
                                       keys=scenario.keys)
            if scenario.crash_after:
                run.states = [self._crash_and_resume(run)]
            else:
                with ThreadPoolExecutor(scenario.turns) as pool:
                    futures = [pool.submit(self._converse, run, turn)
                               for turn in range(scenario.turns)]
                    run.states = [f.result() for f in futures]
            self._wait_for_tasks(run)
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        run.seconds = time.monotonic() - start
        self.say(f"  {'done' if run.error is None else 'FAILED':6} {scenario.tag:<3}"
                 f"{scenario.title:<32} {variant:<10} {run.seconds:4.1f} s "
                 f"(at +{time.monotonic() - self.t0:4.1f} s)")
        return run

    def _converse(self, run: Run, turn: int) -> dict[str, Any]:
        from .agent import Agent, ScriptedModel, toolbox

        agent = Agent(toolbox(run.variant), ScriptedModel(),  # type: ignore[arg-type]
                      checkpoint=self.tmp / f"{run.order_id}-turn{turn}.json",
                      timeouts=dict(run.scenario.timeouts))
        return agent.run(run.order_id)

    def _crash_and_resume(self, run: Run) -> dict[str, Any]:
        checkpoint = self.tmp / f"{run.order_id}-agent.json"
        base = [sys.executable, "-m", "example_app.agent", "--order", run.order_id,
                "--variant", run.variant, "--checkpoint", str(checkpoint)]
        first = subprocess.run([*base, "--crash-after-enqueue", str(run.scenario.crash_after)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)
        if first.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the agent was meant to crash, it exited {first.returncode}: "
                               f"{first.stderr[-1500:]}")
        second = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=60)
        if second.returncode != 0:
            raise RuntimeError(f"the resumed agent exited {second.returncode}: {second.stderr[-1500:]}")
        return dict(json.loads(checkpoint.read_text()))

    def _wait_for_tasks(self, run: Run) -> None:
        """Wait until every task the agents enqueued has finished (abandoned ones too)."""
        from celery.result import AsyncResult

        from .celery_app import app

        ids = {e["task_id"] for s in run.states for e in s.get("enqueued", [])}
        results = [AsyncResult(i, app=app) for i in ids]
        wait_for(lambda: all(r.ready() for r in results), 60, f"the tasks of {run.order_id}",
                 interval=0.1)

    # -- counting ------------------------------------------------------------------------------

    def count(self, runs: list[Run]) -> None:
        """Fill in each run's effect counts (from the provider) and events."""
        from .agent import order_details

        ledger = self.provider.ledger(prefix=f"ord_{self.run_id}_")
        gate = self._gate_events()
        for run in runs:
            email = order_details(run.order_id)["email"]
            run.counts = (ledger["charges"].get(run.order_id, 0), ledger["emails"].get(email, 0),
                          ledger["shipments"].get(run.order_id, 0))
            agent_events = Counter(e for s in run.states for e in s.get("events", [])
                                   if not e.startswith("resumed"))
            if agent_events:
                run.events.append("agent: " + _counted(agent_events))
            for resource, kinds in ledger["events"].get(run.order_id, {}).items():
                if kinds != {"created": 1}:
                    run.events.append(f"provider {resource}: {_counted(kinds)}")
            keys = {m["name"]: m["idempotency_key"] for s in run.states for m in s["messages"]
                    if m.get("idempotency_key")}
            at_enqueue = Counter(m["name"] for s in run.states for m in s["messages"]
                                 if m.get("answered_at_enqueue"))
            for tool, n in at_enqueue.items():
                run.events.append(f"enqueue of {tool} answered from the store, nothing sent"
                                  + (f" x{n}" if n > 1 else ""))
            for tool in TOOLS:
                outcomes = gate.get(keys.get(tool, ""), Counter())
                if outcomes and outcomes != Counter(claimed=1, recorded=1):
                    run.events.append(f"gate {tool}: {_counted(outcomes)}")
            if run.variant == "idempotent" and keys and self.event_log is None:
                run.events.append("gate: (no event log from an external worker)")
            # A tool message's content is the tool's outcome; the charge is its "result".
            charges = [m["content"].get("result") for s in run.states for m in s["messages"]
                       if m.get("name") == "charge_card" and isinstance(m.get("content"), dict)]
            charge_ids = {c["id"] for c in charges if isinstance(c, dict) and c.get("id")}
            if len(run.states) > 1 or len(charge_ids) > 1:
                who = f"the {len(run.states)} agent turns" if len(run.states) > 1 else "the agent"
                run.events.append(f"{who} got the same charge id" if len(charge_ids) == 1
                                  else f"{who} got {len(charge_ids)} different charge ids")

    def _gate_events(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        if self.event_log is None or not self.event_log.exists():
            return out
        for line in self.event_log.read_text(errors="replace").splitlines():
            m = re.search(r"celery_idem (\w+) key=(\S+)", line)
            if m:
                out.setdefault(m.group(2), Counter())[m.group(1)] += 1
        return out


def _counted(counts: Any) -> str:
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


def verdict(runs: list[Run]) -> list[str]:
    """The reasons the demo fails (empty: it passed)."""
    problems = []
    by = {(r.scenario.tag, r.variant): r for r in runs}
    for s in SCENARIOS:
        naive, idem = by[(s.tag, "naive")], by[(s.tag, "idempotent")]
        for r in (naive, idem):
            if r.error:
                problems.append(f"row {s.tag} {r.variant}: {r.error}")
        if not s.limit and idem.counts != (1, 1, 1):
            problems.append(f"row {s.tag}: the idempotent tools had {_effects(idem.counts)}; "
                            f"expected exactly one of each")
        if max(naive.counts) <= 1:
            problems.append(f"row {s.tag}: the naive tools had {_effects(naive.counts)}: the "
                            f"fault did not reproduce the duplicate")
    return problems


def _effects(counts: tuple[int, int, int]) -> str:
    return f"{counts[0]} charge(s), {counts[1]} e-mail(s), {counts[2]} shipment(s)"


def table(runs: list[Run]) -> str:
    """The side-by-side table, then what happened in each row."""
    by = {(r.scenario.tag, r.variant): r for r in runs}
    defences = {"gate": "ok: gate", "key": "ok: provider key"}
    width = 100
    head = f"{'':<4}{'':<32}{'':<9}"
    lines = [
        "",
        f"{head}{'naive (celery.Task)':<24}{'idempotent (IdempotentTask)':<30}",
        f"{'row':<4}{'scenario':<32}{'provider':<9}" + f"{'charge':>7}{'email':>7}{'ship':>7}   " * 2
        + "verdict",
        "-" * width,
    ]
    def row(s: Scenario) -> str:
        n, i = by[(s.tag, "naive")], by[(s.tag, "idempotent")]
        if i.error or n.error:
            status = "ERROR"
        elif s.limit:
            status = "limit, see note"
        else:
            status = defences[s.defence] if i.counts == (1, 1, 1) else "FAIL"
        cells = "".join(f"{c:>7}" for c in n.counts) + "   " + "".join(f"{c:>7}" for c in i.counts)
        return f"{s.tag:<4}{s.title:<32}{'keys' if s.keys else 'no keys':<9}{cells}   {status}"

    lines += [row(s) for s in SCENARIOS if not s.limit]
    # The limit rows below their own rule: their idempotent counts above 1 are what
    # idempotency does not give you, not a failure, and must not read as one of the ok rows.
    lines += ["-" * width, "limits (what idempotency alone does not give you):"]
    for s in SCENARIOS:
        if s.limit:
            lines.append(row(s))
            lines += textwrap.wrap(s.limit, width, initial_indent="    note: ",
                                   subsequent_indent=" " * 10)
    lines.append("-" * width)
    for text in LEGEND:
        lines += textwrap.wrap(text, width)
    return "\n".join(lines)


def details(runs: list[Run]) -> str:
    """What happened in each row: the agent's, the provider's and the gate's events."""
    by = {(r.scenario.tag, r.variant): r for r in runs}
    width = 100
    lines = ["What happened (events seen by the agent, the provider and celery_idem's gate):"]
    for s in SCENARIOS:
        lines += textwrap.wrap(f"{s.story}.", width, initial_indent=f"{s.tag:<4}",
                               subsequent_indent=" " * 4)
        for variant in VARIANTS:
            r = by[(s.tag, variant)]
            text = "; ".join(r.events) or "no retries, no duplicates"
            lines += textwrap.wrap(text, width, initial_indent=f"    {variant:<11}",
                                   subsequent_indent=" " * 15)
        if s.limit:
            lines += textwrap.wrap(s.limit, width, initial_indent="    note:      ",
                                   subsequent_indent=" " * 15)
    lines.append("")
    lines += textwrap.wrap(GATE_LEGEND, width)
    return "\n".join(lines)


LEGEND = (
    "charge = charges per order, email = e-mails per recipient, ship = shipments per order, all "
    "counted in the provider's database.",
    "provider: 'keys' = it honours Idempotency-Key (like real payment providers); 'no keys' = it "
    "ignores it.",
    "verdict: 'gate' = celery_idem let one execution of the body through; 'provider key' = the "
    "key the tool forwarded made the provider answer the retry with the original effect.",
)
GATE_LEGEND = (
    "gate: claimed = this attempt ran the body; recorded = its result was stored; waited = a "
    "duplicate found the action running, waited and returned its result; duplicate = found it "
    "done, body not run; released = a timeout gave the claim back so Celery's autoretry could "
    "run the body again."
)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m example_app.demo",
        description="Naive vs idempotent Celery write tools under real faults, side by side.")
    p.add_argument("--broker", help="broker URL (default: $CELERY_BROKER_URL, else "
                   "sqla+sqlite:/// in a temporary directory)")
    p.add_argument("--backend", help="result backend URL (default: $CELERY_RESULT_BACKEND, "
                   "else db+sqlite:/// in a temporary directory)")
    p.add_argument("--store", help="idempotency store URL (default: $CELERY_IDEM_STORE, else "
                   "the result backend)")
    p.add_argument("--payments-db", help="SQLAlchemy URL of the provider's database (default: "
                   "SQLite in the temporary directory)")
    p.add_argument("--payments-url", help="use a provider already running there (default: "
                   "start one on a free loopback port)")
    p.add_argument("--no-worker", action="store_true",
                   help="use the workers already consuming $EXAMPLE_QUEUE (and, unless "
                   "--payments-url, the provider at $EXAMPLE_PAYMENTS_URL) instead of starting them")
    p.add_argument("--pool", default="threads", help="worker pool (default: threads)")
    p.add_argument("--concurrency", type=int, default=16, help="worker concurrency (default: 16)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    p.add_argument("--quiet", action="store_true", help="print only the table and the verdict")
    return p


def configure(args: argparse.Namespace, tmp: Path, run_id: str) -> dict[str, str]:
    """Put this run's settings in ``os.environ`` (for this process and its children).

    With its own worker the run is private: SQLite files in ``tmp`` unless told otherwise, and
    a queue, key prefix and event log of its own. With ``--no-worker`` it uses what the
    running workers use: the flags, else the environment, else the app's defaults.
    """
    env = os.environ
    chosen = {"CELERY_BROKER_URL": args.broker, "CELERY_RESULT_BACKEND": args.backend,
              "CELERY_IDEM_STORE": args.store}
    if not args.no_worker:
        defaults = {"CELERY_BROKER_URL": f"sqla+sqlite:///{tmp}/broker.sqlite",
                    "CELERY_RESULT_BACKEND": f"db+sqlite:///{tmp}/results.sqlite"}
        for name, default in defaults.items():
            chosen[name] = chosen[name] or env.get(name) or default
        chosen.update(EXAMPLE_QUEUE=f"demo-{run_id}", CELERY_IDEM_KEY_PREFIX=f"demo-{run_id}:",
                      EXAMPLE_EVENT_LOG=str(tmp / "idempotency-events.log"))
    env.update({name: value for name, value in chosen.items() if value})
    from . import celery_app  # reads the environment once, now that it is final

    names = ("EXAMPLE_QUEUE", "CELERY_IDEM_KEY_PREFIX", "EXAMPLE_EVENT_LOG", "EXAMPLE_PAYMENTS_URL")
    return {"CELERY_BROKER_URL": celery_app.broker_url,
            "CELERY_RESULT_BACKEND": celery_app.backend_url,
            "CELERY_IDEM_STORE": celery_app.store_url,
            **{name: celery_app.setting(name) for name in names}}


def cleanup_redis(settings: dict[str, str]) -> None:
    """Delete this run's Redis keys (by exact name or prefix; never FLUSHALL)."""
    urls = {u for u in (settings["CELERY_BROKER_URL"], settings["CELERY_IDEM_STORE"])
            if u.startswith(("redis://", "rediss://"))}
    if not urls:
        return
    import redis

    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            queue = settings.get("EXAMPLE_QUEUE", "")
            if queue:
                client.delete(queue, *client.scan_iter(match=f"_kombu.binding*.{queue}"))
            prefix = settings.get("CELERY_IDEM_KEY_PREFIX", "")
            if prefix:
                for name in client.scan_iter(match=prefix + "*", count=1000):
                    client.delete(name)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    run_id = uuid.uuid4().hex[:6]
    tmp = Path(tempfile.mkdtemp(prefix="celery-idem-demo-"))
    settings = configure(args, tmp, run_id)
    table_prefix = os.environ.get("EXAMPLE_TABLE_PREFIX", "")
    out = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    out("celery_idem demo: an agent's write tools, naive vs IdempotentTask, under real faults")
    out(textwrap.fill(
        "Each row runs the agent's conversation (lookup_order -> charge_card -> create_shipment "
        "-> send_email) twice, once with plain celery.Task tools and once with IdempotentTask "
        "tools, each on its own order, against a provider that fails on purpose.", 100))
    out(f"  broker   {settings['CELERY_BROKER_URL']}")
    out(f"  backend  {settings['CELERY_RESULT_BACKEND']}")
    out(f"  store    {settings['CELERY_IDEM_STORE']}")
    procs: list[subprocess.Popen[Any]] = []
    runs: list[Run] = []
    try:
        url = args.payments_url
        if url is None and args.no_worker:
            url = settings["EXAMPLE_PAYMENTS_URL"]  # the provider the running workers call
        if url is None:
            db = args.payments_db or f"sqlite:///{tmp}/provider.sqlite"
            proc, url = start_provider(db, table_prefix, tmp / "provider.log")
            procs.append(proc)
            out(f"  provider {url} (a separate process; database {db})")
        else:
            if not ProviderClient(url, timeout=2, retries=0).health():
                raise RuntimeError(f"no provider answers at {url} (start one with "
                                   f"python -m example_app.payments serve, or drop --no-worker)")
            out(f"  provider {url} (already running)")
        os.environ["EXAMPLE_PAYMENTS_URL"] = settings["EXAMPLE_PAYMENTS_URL"] = url
        event_log = Path(settings["EXAMPLE_EVENT_LOG"]) if settings.get("EXAMPLE_EVENT_LOG") else None
        if not args.no_worker:
            t = time.monotonic()
            procs.append(start_worker(run_id, args.pool, args.concurrency, tmp / "worker.log"))
            out(f"  worker   celery worker -P {args.pool} -c {args.concurrency} "
                f"(ready in {time.monotonic() - t:.1f} s; log {tmp / 'worker.log'}, deleted at "
                f"the end unless --keep)")
        else:
            check_worker(settings.get("EXAMPLE_QUEUE"))
            out("  worker   (already running)")
        demo = Demo(args, tmp, run_id, url, event_log)
        out(f"running {len(SCENARIOS)} scenarios x {len(VARIANTS)} variants at once "
            f"(orders ord_{run_id}_*):")
        with ThreadPoolExecutor(len(SCENARIOS) * len(VARIANTS)) as pool:
            futures = [pool.submit(demo.run_one, s, v) for s in SCENARIOS for v in VARIANTS]
            runs = [f.result() for f in as_completed(futures)]
        demo.count(runs)
    except RuntimeError as exc:  # a process did not start, or no worker answers
        print(f"FAIL: {exc}\nlogs: {tmp}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(procs):
            stop(proc)
        if not args.no_worker:  # this run owns its queue and key prefix
            try:
                cleanup_redis(settings)
            except Exception as exc:  # cleanup must not hide the result
                print(f"warning: could not clean up Redis keys: {exc}", file=sys.stderr)
    # The outcome first: the table and the verdict, then the details, then where the logs are.
    print(table(runs))
    problems = verdict(runs)
    elapsed = time.monotonic() - started
    if problems:
        print(f"\nFAIL after {elapsed:.1f} s:")
        for p in problems:
            print(f"  - {p}")
    else:
        print(textwrap.fill(
            f"PASS in {elapsed:.1f} s: the idempotent tools had exactly one effect per action in "
            f"every row above the limits; the naive tools had duplicates in every row.", 100))
    if not args.quiet:
        print()
        print(details(runs))
    if args.keep or problems:
        print(f"\nlogs kept in {tmp} (worker.log, provider.log)")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        print("\nlogs: deleted; keep them with --keep (python -m example_app.demo --keep, or "
              "make demo DEMO_ARGS=--keep)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
