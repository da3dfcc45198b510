"""``celery -A proj idem relay`` and ``celery -A proj idem intents``: the relay from a shell.

    celery -A proj idem relay [--once] [--dry-run]   re-send lost intents (celery_idem.contrib.relay)
    celery -A proj idem intents                      intents kept: pending, overdue, stale, oldest

Both take ``--json``; stored strings are printed escaped (:func:`celery_idem.contrib.ops.shown`).
:mod:`celery_idem.contrib.cli` adds both to its ``idem`` group.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption
from kombu.exceptions import OperationalError

from ..config import settings
from .cli_output import (
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    Run,
    ago_text,
    json_option,
    run_for,
    store_location,
)
from .ops import shown
from .relay import Relay, RelayReport

__all__ = ["intents", "relay"]


def _report_doc(report: RelayReport) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(report).items() if k not in ("unclaimed", "full")}


def _report_text(report: RelayReport, dry_run: bool) -> str:
    verb = "would relay" if dry_run else "relayed"
    lines = [f"{verb} key={shown(r.key)} task_id={shown(r.task_id)} queue={shown(r.queue)} "
             f"reason={r.reason}" for r in report.resends]
    lines.append(f"{verb} {report.relayed}, waiting {report.waiting}, closed {report.closed}, "
                 f"stale {report.stale}, postponed {report.postponed}" + (" (dry run: nothing "
                 "was sent, closed or moved)" if dry_run else ""))
    lines += [f"  oldest due on {shown(queue)}: {ago_text(age)}"
              for queue, age in sorted(report.oldest.items())]
    return "\n".join(lines)


@click.command(cls=CeleryCommand)
@click.option("--once", cls=CeleryOption, is_flag=True, help_group="Relay Options",
              help="One pass over the due intents, then exit (default: until interrupted).")
@click.option("--dry-run", cls=CeleryOption, is_flag=True, help_group="Relay Options",
              help="Decide only: print what would be re-sent; send, close and move nothing.")
@json_option
@click.pass_context
def relay(ctx: click.Context, once: bool, dry_run: bool, as_json: bool) -> None:
    """Re-send the messages of lost intents (idempotency_intent), as a worker's relay does.

    Each due intent is closed (its outcome is recorded, or it is stale), postponed (an attempt
    holds a live lease), left waiting (it may still be in its queue) or re-sent with its task
    id. Prints each re-send and the pass's counts; without --once, every pass that did
    something, until Ctrl-C (with --json: one document per pass).
    """
    run = run_for(ctx, as_json)
    read = settings(run.app)
    with run.store() as store:
        if not store.keeps_intents:  # else every pass of a relay left running would say so
            run.fail(EXIT_REFUSED, f"{store_location(store)} keeps no intents: nothing to relay")
        worker = Relay(run.app, store, relay_after=read.relay_after, interval=read.relay_interval,
                       dry_run=dry_run)

        def show(report: RelayReport) -> None:
            if not once and not (report.relayed or report.closed or report.stale):
                return  # a pass that changed nothing says nothing
            run.emit(_report_doc(report), _report_text(report, dry_run))

        if once:
            with run.app.connection_for_write() as conn:  # not connected: its transport's errors
                errors = (OperationalError, *conn.connection_errors)
            try:
                show(worker.run_once())
            except errors as exc:
                run.fail(EXIT_UNAVAILABLE, f"the broker cannot be reached: {exc}")
            return
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        worker.run_forever(stop, show)


@click.command(cls=CeleryCommand)
@json_option
@click.pass_context
def intents(ctx: click.Context, as_json: bool) -> None:
    """Count the intents the store keeps: pending (all), overdue (due, not stale), stale
    (their record's ttl has passed: closed by the next relay pass, never re-sent), and the
    age of the oldest per queue."""
    run: Run = run_for(ctx, as_json)
    pending = overdue = stale = 0
    oldest: dict[str, float] = {}
    with run.store() as store:
        if not store.keeps_intents:
            run.fail(EXIT_REFUSED, f"{store_location(store)} keeps no intents")
        now = store.now()
        for intent in store.intents(500):
            pending += 1
            if intent.expires <= now:
                stale += 1
            elif intent.deadline <= now:
                overdue += 1
            oldest[intent.queue] = max(oldest.get(intent.queue, 0.0), now - intent.enqueued)
    doc = {"pending": pending, "overdue": overdue, "stale": stale, "oldest": oldest}
    lines = [f"{name:<9}{count:>6}" for name, count in (("pending", pending), ("overdue", overdue),
                                                         ("stale", stale))]
    lines += [f"oldest on {shown(queue)}: {ago_text(age)}" for queue, age in sorted(oldest.items())]
    run.emit(doc, "\n".join(lines))
