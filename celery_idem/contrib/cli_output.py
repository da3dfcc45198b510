"""What the ``celery -A proj idem`` commands show an operator, and how they end.

The commands (:mod:`celery_idem.contrib.cli`) ask; this module answers in the operator's terms:
exit codes and error documents, the options that choose what is shown (``--json``, ``--task``,
``--decode``, ``--reason``), and records, leases, expiries and live decisions as text or JSON.

Everything the commands print that came from the store or the broker (keys, owners, task ids,
error text, task names in events) goes through :func:`celery_idem.contrib.ops.shown` or
:func:`celery_idem.contrib.ops.printable`: a record planted in the store with an ANSI escape or a
newline in its key prints as ``$'...\\x1b[31m...'``, never as itself. JSON output is escaped by
``json.dumps`` (every control and non-ASCII character as ``\\uXXXX``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NoReturn

import click
from celery import Celery
from celery.bin.base import CeleryOption

from ..app import get_store
from ..events import EVENT_TYPE
from ..exceptions import CorruptRecord, ImproperlyConfigured, StoreUnavailable
from ..keys import parse_key
from ..records import Record, State
from ..stores.base import Store
from ..task import IdempotentTask
from . import ops

__all__ = [
    "ERROR_NAMES", "EXIT_CHANGED", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_REFUSED", "EXIT_UNAVAILABLE",
    "SCAN_BATCH", "STATE_CHOICES", "Run", "ago_text", "decode_option",
    "expiry_text", "fail_with", "json_option", "lease_text", "live_decisions", "operation_of",
    "outcome_of", "reason_option", "record_doc", "run_for", "scan_records", "store_location",
    "task_leases", "task_option", "utc_text",
]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_REFUSED = 2
EXIT_CHANGED = 3
EXIT_UNAVAILABLE = 4

ERROR_NAMES = {
    EXIT_NOT_FOUND: "not_found",
    EXIT_REFUSED: "refused",
    EXIT_CHANGED: "changed",
    EXIT_UNAVAILABLE: "store_unavailable",
}

#: Records fetched per store round trip by ``list`` and ``stats``.
SCAN_BATCH = 500

STATE_CHOICES = click.Choice([s.value for s in State])

def fail_with(exit_code: int, message: str, as_json: bool, error: str | None = None) -> NoReturn:
    """End the command with ``exit_code``, the reason on stderr (a JSON object with --json)."""
    if as_json:
        doc = {"error": error or ERROR_NAMES.get(exit_code, "error"), "message": message}
        click.echo(json_text(doc), err=True)
    else:
        # A message may quote a store's or a broker's exception text: escaped like the rest.
        click.echo(f"Error: {ops.printable(message)}", err=True)
    raise click.exceptions.Exit(exit_code)


def json_text(doc: Any, indent: int | None = None) -> str:
    """``doc`` as JSON safe for a terminal: no control character is left as itself.

    ``json.dumps`` (``ensure_ascii``) writes every control character below U+0020 and every
    non-ASCII one (U+202E...) as ``\\uXXXX``, but leaves DEL (U+007F) as it is; DEL only ever
    appears inside a JSON string, where ``\\u007f`` is the same value.
    """
    return json.dumps(doc, indent=indent, default=str).replace("\x7f", "\\u007f")


@dataclass
class Run:
    """One command's context: the app, its store, the output mode."""

    app: Celery
    as_json: bool

    def fail(self, exit_code: int, message: str, error: str | None = None) -> NoReturn:
        fail_with(exit_code, message, self.as_json, error)

    @contextlib.contextmanager
    def store(self) -> Iterator[Store]:
        """The app's store, with store errors turned into exit codes."""
        try:
            yield get_store(self.app)
        except StoreUnavailable as exc:
            self.fail(EXIT_UNAVAILABLE, str(exc))
        except ImproperlyConfigured as exc:
            self.fail(EXIT_REFUSED, f"the idempotency store is misconfigured: {exc}")
        except CorruptRecord as exc:
            self.fail(EXIT_REFUSED, str(exc))

    def emit(self, doc: Any, text: str) -> None:
        """Print ``doc`` as JSON with --json, else ``text`` (already escaped by the command)."""
        click.echo(json_text(doc, indent=2) if self.as_json else text)

    def warn(self, message: str) -> None:
        """One warning line on stderr (also with --json: stdout stays one JSON document)."""
        click.echo(f"Warning: {ops.printable(message)}", err=True)


def run_for(ctx: click.Context, as_json: bool) -> Run:
    return Run(ctx.obj.app, as_json)


json_option = click.option(
    "--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Output Options",
    help="Print one JSON document (errors go to stderr as JSON).",
)
task_option = click.option(
    "--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Filter Options",
    help="Only keys of this task: keys that start with its operation (the task name, or "
         "its idempotency_operation) and ':' or '@' (a scope), derived and per-call keys "
         "alike.",
)
reason_option = click.option(
    "--reason", cls=CeleryOption, metavar="TEXT", default=None, help_group="Audit Options",
    help="Why: logged at WARNING on the celery_idem logger with your OS user and host, "
         "and sent in the idem-operator event when the app sends events.",
)
decode_option = click.option(
    "--decode", cls=CeleryOption, is_flag=True, help_group="Output Options",
    help="Decode the stored result with the app's result serializer (accept_content "
         "applies). Runs the serializer on stored bytes: with pickle accepted, a planted "
         "record runs its code. Without it only the size and content type are shown.",
)


# -- formatting ------------------------------------------------------------------------------


def utc_text(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def ago_text(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def lease_text(rec: Record, now: float, lease: float | None = None) -> str:
    """An in-progress claim's lease, with what it says about its holder (:func:`ops.lease_view`).

    ``lease`` is the duration of the record's task (:func:`task_leases`); without it the time
    left is all there is to say: ``lease 41.2 s left``.
    """
    view = ops.lease_view(rec, now, lease)
    if view is None:
        return "-"
    left = ago_text(view.remaining)
    if view.status == "expired":
        return f"expired {left} ago"
    if view.status == "live":
        return f"live, on schedule, {left} left"
    if view.status == "not_renewed":
        return (f"not renewed for {ago_text(view.not_renewed_for or 0.0)} (held after an error, or "
                f"its holder is gone or stalled), expires in {left}")
    return f"lease {left} left"


def task_leases(app: Celery) -> Callable[[str], float | None]:
    """The lease duration (``idempotency_lease``) of the task a key belongs to, or None.

    A key's operation (``<operation>[@<scope>]:<ident>``) is its task's name or
    ``idempotency_operation``: the app's idempotent tasks are looked up once. A key no task
    of this app claims, or one whose operation's tasks have different leases, gets None.
    """
    app.loader.import_default_modules()
    by_operation: dict[str, set[float]] = {}
    for task in list(app.tasks.values()):
        if not isinstance(task, IdempotentTask):
            continue
        try:
            cfg = task.idempotency_config
        except (ImproperlyConfigured, TypeError, ValueError):
            continue  # a misconfigured task claims nothing: no verdict for its keys
        by_operation.setdefault(str(cfg.operation), set()).add(float(cfg.lease))

    def lease_of(key: str) -> float | None:
        found = {lease for operation, leases in by_operation.items()
                 if parse_key(key, operation) is not None for lease in leases}
        return found.pop() if len(found) == 1 else None

    return lease_of


def expiry_text(rec: Record, expires: float | None, now: float) -> str:
    """When the record goes (its TTL), and what that means for the next attempt."""
    if expires is None:
        return "-"
    # Nothing happens at expiry itself: only an attempt that arrives afterwards is affected.
    after = {State.DONE: "an attempt arriving after that runs the body again",
             State.FAILED: "an attempt arriving after that runs the body again",
             State.IN_PROGRESS: "unless the holder records or renews it first"}.get(rec.state, "")
    return f"{utc_text(expires)} (in {ago_text(expires - now)}" + (f"; {after})" if after else ")")


def record_doc(rec: Record, now: float, lease: float | None = None) -> dict[str, Any]:
    """The record's metadata as JSON-ready values (never its decoded result); ``lease`` is its
    task's lease duration when known (``lease_status``, :func:`ops.lease_view`)."""
    doc: dict[str, Any] = {
        "key": rec.key,
        "state": rec.state.value,
        "token": rec.token,
        "owner": rec.owner,
        "task_id": rec.task_id,
        "attempt": rec.attempt,
        "lease_expires": rec.lease_expires,
        "lease_remaining": None,
        "lease_expired": None,
        "lease_status": None,
        "lease_seconds": lease,
        "not_renewed_for": None,
        "updated": rec.updated,
        "payload_hash": rec.payload_hash,
        "content_type": rec.content_type,
        "result_bytes": None if rec.data is None else len(rec.data),
    }
    view = ops.lease_view(rec, now, lease)  # None unless an in-progress claim with a lease
    if view is not None:
        doc.update(lease_remaining=round(view.remaining, 3), lease_expired=view.remaining <= 0,
                   lease_status=view.status)
        if view.not_renewed_for is not None:
            doc["not_renewed_for"] = round(view.not_renewed_for, 3)
    return doc


def outcome_of(app: Celery, rec: Record, decode: bool = False) -> tuple[dict[str, Any], str]:
    """The recorded error, or the result's size (decoded only with ``decode``): celery_idem.contrib.ops."""
    conf = app.conf
    return ops.outcome(rec, conf.result_serializer, conf.result_accept_content or conf.accept_content,
                       decode=decode)


def store_location(store: Store) -> str:
    location = getattr(store, "location", None)
    return f"{store!r} at {location}" if location else repr(store)


def operation_of(app: Celery, task_name: str) -> str:
    """The key operation of ``task_name``: its ``idempotency_operation``, else the name."""
    app.loader.import_default_modules()
    task = app.tasks.get(task_name)
    if isinstance(task, IdempotentTask):
        return str(task.idempotency_config.operation)
    return task_name


def scan_records(
    store: Store, state: State | None, operation: str | None
) -> Generator[Record, None, None]:
    """The records of ``state`` (None: all) whose key is ``operation``'s (None: any), in batches."""
    # An operation's keys are "<operation>:..." or, in a scope, "<operation>@<scope>:...".
    prefixes = None if operation is None else (operation + ":", operation + "@")
    for rec in store.scan(state, count=SCAN_BATCH):
        if prefixes is None or rec.key.startswith(prefixes):
            yield rec


def live_decisions(app: Celery, seconds: float, task_name: str | None) -> Counter[tuple[str, str]]:
    """Count ``task-idempotency`` events by (task, outcome) for ``seconds``, from the broker.

    The producer's own decisions (``answered``: an enqueue of a done key that published
    nothing) leave no record to count; their events are the only trace, so the live count is
    where ``stats`` shows them. Worker events do not name the task: ``task-received`` does.
    """
    names: dict[str, str] = {}
    counts: Counter[tuple[str, str]] = Counter()
    deadline = time.monotonic() + seconds

    def on_event(event: dict[str, Any]) -> None:
        kind, uuid = event.get("type"), event.get("uuid") or ""
        if kind == "task-received" and event.get("name"):
            names[uuid] = event["name"]
        elif kind == EVENT_TYPE:
            name = event.get("name") or names.get(uuid) or "?"
            if task_name is None or name == task_name:
                counts[(name, str(event.get("outcome")))] += 1

    def on_iteration() -> None:
        # Called before each wait for events (at most 1 s each): stop at the deadline, busy
        # or idle. capture()'s own timeout only counts consecutive idle seconds.
        if time.monotonic() >= deadline:
            receiver.should_stop = True

    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        receiver.on_iteration = on_iteration
        with contextlib.suppress(socket.timeout, TimeoutError):
            receiver.capture(limit=None, timeout=seconds + 1, wakeup=False)
    return counts
