"""``celery -A proj idem ...``: look at and repair idempotency records from a shell.

Registered as a Celery sub-command through the ``celery.commands`` entry point. It uses the
app's own store (``idempotency_store``, else ``result_backend``) and key prefix::

    celery -A proj idem show KEY [--decode]   one record: state, token, owner, lease, result size
    celery -A proj idem list [--state S] [--task NAME] [--limit N]
    celery -A proj idem stats [--task NAME] [--events S]   records per state (and live decisions)
    celery -A proj idem purge [--batch N] [--max-seconds S] [--reason TEXT]   delete expired (SQL)
    celery -A proj idem release KEY [--token N] [--yes] [--reason TEXT]
    celery -A proj idem forget KEY [--token N] [--yes] [--reason TEXT]   forget an outcome
    celery -A proj idem key TASK [ARGS...] [--kwargs JSON]
    celery -A proj idem mcp --toolbox MODULE:NAME [--http HOST:PORT]   serve agent tools (MCP)
    celery -A proj idem relay [--once] [--dry-run]   re-send lost intents; idem intents: count them

Every command takes ``--json`` (one JSON document on stdout; errors as JSON on stderr).

Trust: the commands read what is in the store, which anyone with write access to it could have
put there. Stored strings are printed escaped (:func:`celery_idem.contrib.ops.shown`), and a stored result
is decoded with the app's serializer only with ``show --decode`` (with pickle accepted, decoding
a planted record runs its code). The verbs that change records (``release``, ``forget``,
``purge``) log the OS user, the host and ``--reason`` at WARNING on the ``celery_idem`` logger and
send an ``idem-operator`` event when the app sends events.

Exit codes:

=== ==========================================================================
0   done
1   no record for the key
2   refused: bad usage, unknown task, a record in the wrong state, not confirmed,
    a store that is misconfigured or holds an unreadable record
3   the record changed meanwhile, or its token is not the ``--token`` given
4   the store cannot be reached
=== ==========================================================================
"""

from __future__ import annotations

import json
import time
from itertools import islice
from typing import Any

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from ..exceptions import ImproperlyConfigured
from ..records import Record, State
from ..stores.base import Store
from ..task import IdempotentTask
from . import ops
from .cli_output import (
    EXIT_CHANGED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    STATE_CHOICES,
    Run,
    ago_text,
    decode_option,
    expiry_text,
    fail_with,
    json_option,
    lease_text,
    live_decisions,
    operation_of,
    outcome_of,
    reason_option,
    record_doc,
    run_for,
    scan_records,
    store_location,
    task_leases,
    task_option,
    utc_text,
)
from .cli_relay import intents, relay
from .maintenance import purge_expired
from .ops import Operator, printable, shown

__all__ = ["EXIT_CHANGED", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_REFUSED", "EXIT_UNAVAILABLE", "idem", "mcp"]


# -- commands --------------------------------------------------------------------------------


@click.group(name="idem", commands=[relay, intents])  # celery_idem.contrib.cli_relay
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def idem(ctx: click.Context) -> None:
    """Inspect and repair celery_idem's idempotency records.

    Exit codes: 0 done, 1 no such record, 2 refused (usage, state, not confirmed,
    misconfigured store), 3 the record changed meanwhile, 4 the store cannot be reached.
    """


@idem.command(cls=CeleryCommand)
@click.argument("key")
@decode_option
@json_option
@click.pass_context
def show(ctx: click.Context, key: str, decode: bool, as_json: bool) -> None:
    """Show the record of KEY: state, token, owner, lease, task id, the result's size.

    The result itself only with --decode, which runs the app's result serializer on the stored
    bytes (with pickle accepted: whatever code a planted record holds).
    """
    run = run_for(ctx, as_json)
    with run.store() as store:
        rec = store.get(key)
        if rec is None:
            run.fail(EXIT_NOT_FOUND, f"no record for {key!r} in {store_location(store)} (never "
                                     f"claimed, or its TTL has passed)")
        now = store.now()
        expires = store.expires_at(key)
    lease = task_leases(run.app)(rec.key) if rec.state is State.IN_PROGRESS else None
    if decode and rec.state is State.DONE:
        run.warn(f"--decode runs the result serializer on the bytes stored under {key!r} "
                 f"({rec.content_type or 'no content type'}, {len(rec.data or b'')} bytes); "
                 f"with pickle accepted that runs whatever code they hold. Decode only records "
                 f"whose writers you trust.")
    outcome, summary = outcome_of(run.app, rec, decode)
    doc = {**record_doc(rec, now, lease), "expires": expires, **outcome}
    lines = [
        ("key", shown(rec.key)),
        ("state", rec.state.value),
        ("token", str(rec.token)),
        ("owner", shown(rec.owner) if rec.owner else "-"),
        ("task id", shown(rec.task_id) if rec.task_id else "-"),
        ("attempt", str(rec.attempt)),
        ("lease", lease_text(rec, now, lease) + (f" (until {utc_text(rec.lease_expires)})"
                                             if rec.state is State.IN_PROGRESS else "")),
        ("updated", f"{utc_text(rec.updated)} ({ago_text(now - rec.updated)} ago)"
         if rec.updated is not None else "-"),
        ("expires", expiry_text(rec, expires, now)),
    ]
    if doc["lease_status"] == "not_renewed":
        # The record does not keep the error; the holder's task state in the result backend
        # does (read as JSON only, never with the app's serializer), as does the worker's log.
        error = holder_failure(run.app, rec.task_id) if rec.task_id else None
        doc["holder_error"] = error
        if error is not None:
            lines.append(("why", f"held after {printable(error)}: its task {shown(rec.task_id)} "
                                 f"failed with an error neither released nor recorded, and the "
                                 f"claim is kept until its lease runs out"))
        else:
            lines.append(("why", f"the record does not say: a 'celery_idem held key=... task_id="
                                 f"{_or_dash(rec.task_id)}' log line (or held event) names the "
                                 f"error (error=TYPE); without one, the holder died or is "
                                 f"stalled"))
    if rec.payload_hash:
        lines.append(("payload hash", shown(rec.payload_hash)))
    if rec.state is State.DONE:
        lines.append(("result", summary if decode else
                      f"not decoded: {len(rec.data or b'')} bytes of "
                      f"{printable(rec.content_type or 'unknown type')} (--decode decodes it)"))
    elif rec.state is State.FAILED:
        lines.append(("error", summary))
    run.emit(doc, "\n".join(f"{name:<13}{value}" for name, value in lines))


@idem.command(name="list", cls=CeleryCommand)
@click.option("--state", "state_name", cls=CeleryOption, type=STATE_CHOICES,
              help_group="Filter Options", help="Only records in this state.")
@task_option
@click.option("--limit", cls=CeleryOption, type=click.IntRange(min=1), default=50,
              show_default=True, help_group="Output Options",
              help="Show at most this many records (the scan stops there).")
@json_option
@click.pass_context
def list_(ctx: click.Context, state_name: str | None, task_name: str | None, limit: int,
          as_json: bool) -> None:
    """List records, optionally of one state and one task, up to --limit.

    Redis walks the prefix with SCAN, SQL pages along the primary key (and the state
    index); neither holds more than one batch in memory, and both stop at --limit.
    """
    run = run_for(ctx, as_json)
    state = State(state_name) if state_name else None
    operation = operation_of(run.app, task_name) if task_name else None
    lease_of = task_leases(run.app)
    with run.store() as store:
        now = store.now()
        found = scan_records(store, state, operation)
        try:
            page = list(islice(found, limit + 1))
        finally:
            found.close()
    more = len(page) > limit
    page = page[:limit]
    leases = [lease_of(r.key) if r.state is State.IN_PROGRESS else None for r in page]
    doc = {"records": [record_doc(r, now, lease) for r, lease in zip(page, leases, strict=True)],
           "count": len(page), "limit": limit, "more": more}
    rows = [("STATE", "TOKEN", "LEASE", "UPDATED", "TASK ID", "KEY")]
    rows += [(r.state.value, str(r.token), lease_text(r, now, lease),
              f"{ago_text(now - r.updated)} ago" if r.updated is not None else "-",
              shown(r.task_id) if r.task_id else "-", shown(r.key))
             for r, lease in zip(page, leases, strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    text = "\n".join(
        "  ".join(cell.rjust(w) if i == 1 else cell.ljust(w) for i, (cell, w) in
                  enumerate(zip(row[:5], widths, strict=True))) + "  " + row[5]
        for row in rows
    )
    if not page:
        text = "no records"
    elif more:
        text += f"\n{len(page)} records shown; more match (raise --limit, or narrow with " \
                f"--state / --task)"
    else:
        text += f"\n{len(page)} record{'s' if len(page) != 1 else ''}"
    run.emit(doc, text)


@idem.command(cls=CeleryCommand)
@task_option
@click.option("--events", "events_seconds", cls=CeleryOption, type=click.FloatRange(min=0.1),
              default=None, metavar="SECONDS", help_group="Output Options",
              help="Also count the decisions of the next SECONDS from the event stream, by "
                   "task and outcome, the producer's (answered at enqueue) included.")
@json_option
@click.pass_context
def stats(ctx: click.Context, task_name: str | None, events_seconds: float | None,
          as_json: bool) -> None:
    """Count records per state (and in-progress claims whose lease has expired).

    Reads every record under the prefix once, a batch at a time: its time grows with the
    store, its memory does not. With --events, then listens to the event stream (workers
    with -E, producers with idempotency_events) and counts decisions by task and outcome.
    """
    run = run_for(ctx, as_json)
    operation = operation_of(run.app, task_name) if task_name else None
    counts = {s.value: 0 for s in State}
    expired = 0
    started = time.monotonic()
    with run.store() as store:
        now = store.now()
        for rec in scan_records(store, None, operation):
            counts[rec.state.value] += 1
            if rec.state is State.IN_PROGRESS and rec.lease_expires is not None \
                    and rec.lease_expires <= now:
                expired += 1
    total = sum(counts.values())
    doc: dict[str, Any] = {**counts, "in_progress_expired": expired, "total": total,
           "seconds": round(time.monotonic() - started, 3)}
    width = max(len(str(total)), 1)
    lines = [f"{name:<12}{count:>{width}}" for name, count in counts.items()]
    if expired:
        lines[0] += f"  ({expired} with an expired lease: the next attempt takes them over)"
    lines.append(f"{'total':<12}{total:>{width}}")
    if events_seconds is not None:
        counts_seen = live_decisions(run.app, events_seconds, task_name)
        doc["decisions"] = [{"task": t, "outcome": o, "count": n}
                            for (t, o), n in sorted(counts_seen.items())]
        doc["decisions_seconds"] = events_seconds
        lines.append(f"\ndecisions in {events_seconds:g} s (task-idempotency events):")
        # Task names and outcomes come from the broker, which anyone may publish to.
        lines += [f"  {printable(o):<12}{n:>6}  {shown(t)}" for (t, o), n in sorted(counts_seen.items())] \
            or ["  none (do the workers run with -E, the producers with idempotency_events?)"]
    run.emit(doc, "\n".join(lines))


@idem.command(cls=CeleryCommand)
@click.option("--batch", cls=CeleryOption, type=click.IntRange(min=1), default=1000,
              show_default=True, help_group="Purge Options",
              help="Rows per DELETE statement (each is short and locks only its batch).")
@click.option("--max-seconds", cls=CeleryOption, type=click.FloatRange(min=0), default=None,
              help_group="Purge Options",
              help="Stop after the batch that passes this many seconds (default: until done).")
@reason_option
@json_option
@click.pass_context
def purge(ctx: click.Context, batch: int, max_seconds: float | None, reason: str | None,
          as_json: bool) -> None:
    """Delete expired records (their TTL has passed) from a SQL store, a batch at a time.

    Expired records already count as absent; this only gives the space back. Redis deletes
    them by itself, so there it does nothing. Safe while workers run, and from several hosts.
    A purge that deleted rows is logged (WARNING, with --reason, user and host) and sent as
    an idem-operator event when the app sends events.
    """
    run = run_for(ctx, as_json)
    operator = Operator.here("cli", reason)
    with run.store() as store:
        report = purge_expired(store, batch=batch, max_seconds=max_seconds)
    doc = report.as_dict()
    if report.deleted:
        # Expired rows are already absent to every reader: nothing an operator can lose. Only a
        # purge that deleted something is an operator's change worth an audit line.
        fields = {"deleted": report.deleted, "batches": report.batches, "complete": report.complete}
        ops.audit("purged", operator, **fields)
        _event(run, "purged", operator, **fields)
    if not report.supported:
        text = f"{store_location(store)} deletes expired records by itself; nothing to purge"
    else:
        text = (f"deleted {report.deleted} expired record{'s' if report.deleted != 1 else ''} "
                f"in {report.batches} batch{'es' if report.batches != 1 else ''} "
                f"({report.seconds:.1f} s)")
        if not report.complete:
            text += "; stopped by --max-seconds, more expired records remain: run it again"
    run.emit(doc, text)


@idem.command(cls=CeleryCommand)
@click.argument("key")
@click.option("--token", cls=CeleryOption, type=int, help_group="Release Options",
              help="Release only if the claim still has this token (as `show` printed it).")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group="Release Options",
              help="Do not ask for confirmation.")
@reason_option
@json_option
@click.pass_context
def release(ctx: click.Context, key: str, token: int | None, yes: bool, reason: str | None,
            as_json: bool) -> None:
    """Give back the in-progress claim of KEY, so the next attempt runs the body.

    An operator's repair for a stuck claim. Fenced: it releases exactly the claim it showed
    you (its token); if the key was taken over or recorded meanwhile, nothing changes and the
    exit code is 3. Done and failed records are outcomes and are never released (exit 2).
    Logged at WARNING on the ``celery_idem`` logger with --reason, your OS user and host.
    """
    run = run_for(ctx, as_json)
    operator = Operator.here("cli", reason)
    with run.store() as store:
        rec = _fenced_record(run, store, key, token, "released", (State.IN_PROGRESS,),
                             "in_progress: only a claim can be released (a done or failed record "
                             "is the outcome; it expires after its TTL)")
        now = store.now()
        live = rec.lease_expires is not None and rec.lease_expires > now
        if not yes:
            lease = task_leases(run.app)(rec.key)
            warning = (
                f"\nThe lease is LIVE ({lease_text(rec, now, lease)}): the holder may still be running "
                f"the body. After the release a duplicate can run it again, and the holder's "
                f"record will be refused (LeaseLost)." if live else ""
            )
            _confirm(run, f"Claim of {shown(key)}: token {rec.token}, task {_or_dash(rec.task_id)}, "
                          f"owner {_or_dash(rec.owner)}, lease {lease_text(rec, now, lease)}.{warning}\n"
                          f"Release it?", "released")
        # The verb the Django admin shares (celery_idem.contrib.ops): fenced on the token and claim id
        # shown here, logged at WARNING with by=cli, the user, the host and the reason.
        _apply(run, ops.release_claim, store, key, rec.token, operator)
    _event(run, "released", operator, key=key, token=rec.token, task_id=rec.task_id,
           owner=rec.owner)
    doc = {"released": True, "key": key, "token": rec.token, "task_id": rec.task_id,
           "owner": rec.owner, "lease_was_live": live}
    run.emit(doc, f"released {shown(key)} (token {rec.token}, task {_or_dash(rec.task_id)}); the "
                  f"next attempt claims it with a higher token (above {rec.token})")


#: The exit code for each reason an operator verb refuses (celery_idem.contrib.ops.Refused.reason).
_REFUSALS = {"not_found": EXIT_NOT_FOUND, "wrong_state": EXIT_REFUSED, "token_mismatch": EXIT_CHANGED,
             "changed": EXIT_CHANGED}


def _apply(run: Run, verb: Any, store: Store, key: str, seen_token: int, operator: Operator) -> None:
    """Run an operator verb of celery_idem.contrib.ops; a refusal ends the command with its exit code."""
    try:
        verb(store, key, seen_token, by=operator)
    except ops.Refused as exc:
        run.fail(_REFUSALS.get(exc.reason, EXIT_REFUSED), str(exc), error=exc.reason)


def _event(run: Run, verb: str, operator: Operator, **fields: Any) -> None:
    """Send the change's idem-operator event (when the app sends events); warn if it failed."""
    failed = ops.send_operator_event(run.app, verb, operator, **fields)
    if failed is not None:
        run.warn(f"the change was made, but its {ops.OPERATOR_EVENT_TYPE} event was not sent "
                 f"({failed}); the log line above is its record")


def _or_dash(value: str | None) -> str:
    return shown(value) if value else "-"


def _fenced_record(run: Run, store: Store, key: str, token: int | None, verb: str,
                   states: tuple[State, ...], wrong_state: str) -> Record:
    """The record of KEY, refused unless there is one (exit 1), in ``states`` (exit 2) and, when
    ``--token`` was given, with that token (exit 3)."""
    rec = store.get(key)
    if rec is None:
        run.fail(EXIT_NOT_FOUND, f"no record for {key!r} in {store_location(store)}")
    if rec.state not in states:
        run.fail(EXIT_REFUSED, f"{key!r} is {rec.state.value}, not {wrong_state}")
    if token is not None and rec.token != token:
        run.fail(EXIT_CHANGED, f"token mismatch: {key!r} has token {rec.token}, and --token was "
                               f"{token} (it was claimed again, or taken over, since that token "
                               f"was read); nothing was {verb}", error="token_mismatch")
    return rec


def _confirm(run: Run, question: str, verb: str) -> None:
    """Ask on stderr; refuse (exit 2) unless the operator says yes."""
    try:
        confirmed = click.confirm(question, default=False, err=True)
    except click.Abort:
        click.echo(err=True)  # end the prompt's line
        confirmed = False
    if not confirmed:
        run.fail(EXIT_REFUSED, f"not confirmed; nothing was {verb} (pass --yes when not "
                               f"interactive)")


@idem.command(cls=CeleryCommand)
@click.argument("key")
@click.option("--token", cls=CeleryOption, type=int, help_group="Forget Options",
              help="Forget only if the record still has this token (as `show` printed it).")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group="Forget Options",
              help="Do not ask for confirmation.")
@reason_option
@json_option
@click.pass_context
def forget(ctx: click.Context, key: str, token: int | None, yes: bool, reason: str | None,
           as_json: bool) -> None:
    """Forget the done or failed outcome of KEY, so the next attempt runs the body again.

    For an action that was undone outside the task (a refund, a deleted order): afterwards a
    duplicate is no longer answered from the record. Fenced: it forgets exactly the record it
    showed you (its token); if the key changed meanwhile, nothing changes and the exit code
    is 3. A claim in progress is not an outcome: use `release` (exit 2). The token is kept, so
    the next claim gets the next token. Logged at WARNING on the ``celery_idem`` logger with
    --reason, your OS user and host. The result is not decoded (``show --decode`` does).
    """
    run = run_for(ctx, as_json)
    operator = Operator.here("cli", reason)
    with run.store() as store:
        rec = _fenced_record(run, store, key, token, "forgotten", (State.DONE, State.FAILED),
                             "done or failed: only an outcome can be forgotten (a claim in "
                             "progress: `release`)")
        outcome, summary = outcome_of(run.app, rec)
        if not yes:
            _confirm(run, f"{rec.state.value.capitalize()} record of {shown(key)}: token {rec.token}, "
                          f"task {_or_dash(rec.task_id)}, "
                          f"{'result' if rec.state is State.DONE else 'error'} {summary}.\n"
                          f"The next attempt of this action will run the body again. Forget it?",
                     "forgotten")
        _apply(run, ops.forget_outcome, store, key, rec.token, operator)
    _event(run, "forgotten", operator, key=key, token=rec.token, original_task_id=rec.task_id,
           state=rec.state.value)
    doc = {"forgotten": True, "key": key, "token": rec.token, "task_id": rec.task_id,
           "state": rec.state.value, **outcome}
    run.emit(doc, f"forgot the {rec.state.value} outcome of {shown(key)} (token {rec.token}, task "
                  f"{_or_dash(rec.task_id)}); the next attempt claims it with a higher token (above "
                  f"{rec.token}) and runs the body")


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a JSON value; quote strings twice, e.g. '\"{text}\"'",
            param_hint="ARGS",
        ) from None


@idem.command(cls=CeleryCommand, context_settings={"ignore_unknown_options": True})
@click.argument("task_name", metavar="TASK")
@click.argument("args", nargs=-1)
@click.option("--kwargs", "kwargs_json", cls=CeleryOption, metavar="JSON",
              help_group="Call Options", help='Keyword arguments as a JSON object: \'{"note":"x"}\'.')
@click.option("--key", "caller_key", cls=CeleryOption, metavar="KEY", default=None,
              help_group="Call Options",
              help="A per-call key, as apply_async(idempotency_key=KEY) passes it.")
@click.option("--scope", cls=CeleryOption, metavar="SCOPE", default=None,
              help_group="Call Options",
              help="A scope, as apply_async(idempotency_scope=SCOPE) passes it.")
@json_option
@click.pass_context
def key(ctx: click.Context, task_name: str, args: tuple[str, ...], kwargs_json: str | None,
        caller_key: str | None, scope: str | None, as_json: bool) -> None:
    """Print the key a call of TASK with ARGS would get (ARGS are JSON values).

    Example: celery -A proj idem key proj.tasks.charge '"ord_1"' 4200 --kwargs '{"note":"x"}'
    """
    run = run_for(ctx, as_json)
    values = [_json_value(a) for a in args]
    kwargs: Any = {}
    if kwargs_json is not None:
        kwargs = _json_value(kwargs_json)
        if not isinstance(kwargs, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--kwargs")
    run.app.loader.import_default_modules()
    task = run.app.tasks.get(task_name)
    if task is None:
        known = sorted(n for n, t in run.app.tasks.items() if isinstance(t, IdempotentTask))
        run.fail(EXIT_REFUSED, f"no task named {task_name!r}; idempotent tasks: "
                               f"{', '.join(known) or 'none'}")
    if not isinstance(task, IdempotentTask):
        run.fail(EXIT_REFUSED, f"{task_name!r} is not an IdempotentTask: it has no key")
    try:
        computed = task.idempotency_key_for(values, kwargs, idempotency_key=caller_key,
                                            idempotency_scope=scope)
    except (TypeError, ValueError) as exc:
        run.fail(EXIT_REFUSED, str(exc))
    run.emit({"task": task_name, "args": values, "kwargs": kwargs, "key": computed}, shown(computed))


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:8765)",
                                 param_hint="--http")
    return host.strip("[]"), int(port)


@idem.command(cls=CeleryCommand)
@click.option("--toolbox", "toolbox_spec", cls=CeleryOption, metavar="MODULE:NAME", required=True,
              help_group="MCP Options",
              help="The celery_idem.contrib.tools.Toolbox to serve (or a function returning it).")
@click.option("--http", "http", cls=CeleryOption, metavar="HOST:PORT", default=None,
              help_group="MCP Options",
              help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio.")
@click.option("--name", cls=CeleryOption, default="celery-idem", help_group="MCP Options",
              help="The server's name in the MCP handshake.")
@click.option("--max-sessions", cls=CeleryOption, type=click.IntRange(min=1), default=None,
              help_group="MCP Options", help="HTTP: open sessions of all principals (503 beyond).")
@click.option("--principal-sessions", cls=CeleryOption, type=click.IntRange(min=1), default=None,
              help_group="MCP Options", help="HTTP: open sessions of one principal (429 beyond).")
@click.option("--session-idle-timeout", cls=CeleryOption, metavar="SECONDS", default=None,
              type=click.FloatRange(min=0, min_open=True, max=86400), help_group="MCP Options",
              help="HTTP: close a session after this long without requests.")
@click.option("--rate-limit", cls=CeleryOption, metavar="PER_SECOND", default=None,
              type=click.FloatRange(min=0, min_open=True), help_group="MCP Options",
              help="HTTP: requests per second per principal, on average (429 beyond).")
@click.pass_context
def mcp(ctx: click.Context, /, toolbox_spec: str, http: str | None, name: str,
        **limits: Any) -> None:
    """Serve a Toolbox's tools to MCP clients (stdio, or --http HOST:PORT).

    Needs the [mcp] extra: pip install 'celery-idem[mcp]'.

    Example: celery -A proj idem mcp --toolbox proj.agent:tools
    """
    address = _host_port(http) if http is not None else None
    try:
        from . import mcp as idem_mcp
    except ImportError as exc:
        fail_with(EXIT_REFUSED, f"the MCP server needs the MCP SDK ({exc}): pip install "
                            f"'celery-idem[mcp]'", False)
    app: Celery = ctx.obj.app
    app.loader.import_default_modules()
    try:
        toolbox = idem_mcp.load_toolbox(toolbox_spec)
    except (ValueError, ImportError) as exc:
        fail_with(EXIT_REFUSED, str(exc), False)
    # stdout is the protocol's channel on stdio: everything for a human goes to stderr.
    foreign = sorted({t.name for t in toolbox if getattr(t.target, "app", app) is not app})
    if foreign:
        click.echo(f"Warning: tools {printable(', '.join(foreign))} belong to another Celery app "
                   f"than -A {printable(app.main)}", err=True)
    names = printable(", ".join(t.name for t in toolbox))

    def announce(where: str) -> None:  # told once the configuration is checked
        click.echo(f"celery-idem MCP server: {len(toolbox)} tools ({names}) on {printable(where)}",
                   err=True)

    try:
        idem_mcp.serve(toolbox, address, name=name, announce=announce,
                       **{k: v for k, v in limits.items() if v is not None})
    except (ImproperlyConfigured, ValueError) as exc:
        # A bind that needs authentication and has none, say: one line naming what to set.
        fail_with(EXIT_REFUSED, str(exc), False)


def holder_failure(app: Celery, task_id: str) -> str | None:
    """The exception type a task's FAILURE in the result backend names, or None.

    Read raw and parsed with the ``json`` module only: a key-value backend (Redis and the like)
    keeps Celery's meta as the result serializer wrote it, and with JSON (Celery's default) the
    type is ``result.exc_type``. Anything else (pickle, a database backend, no FAILURE) is None:
    an operator's tool never runs the app's serializer on stored bytes unless asked.
    """
    backend = app.backend
    get, key_for = getattr(backend, "get", None), getattr(backend, "get_key_for_task", None)
    if get is None or key_for is None:
        return None
    try:
        raw = get(key_for(task_id))
        meta = json.loads(raw) if raw else None
    except Exception:  # unreachable, or not JSON: say nothing rather than guess
        return None
    if not isinstance(meta, dict) or meta.get("status") != "FAILURE":
        return None
    result = meta.get("result")
    exc_type = result.get("exc_type") if isinstance(result, dict) else None
    return exc_type if isinstance(exc_type, str) and exc_type else None
