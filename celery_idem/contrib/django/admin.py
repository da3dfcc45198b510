"""The records in the Django admin: read-mostly, with the CLI's two repairs as actions.

The list shows key, task, state, token, owner, updated and expires, filters on state and task,
and searches by key; a record's page shows its metadata, a failed record's error and the size and
content type of a done record's result. Nothing is editable, added or deleted through the admin.

What the pages show came from the store, which anyone with write access to it could have
written: keys, owners and task ids are shown with their control and bidi characters escaped
(:func:`celery_idem.contrib.ops.printable`), and a stored result is never decoded by looking at it.
Decoding runs the app's result serializer (with pickle accepted: whatever code a planted record
holds), so it is its own action, **decode**, with a confirmation page that says so, for users
with the change permission, logged at WARNING.

Two repairs, each with a confirmation page (with an optional reason) and each logged (the
``celery_idem`` logger at WARNING with the admin user, the host and the reason; the admin's own
history; an ``idem-operator`` event when the Celery app sends events):

* **release**: gives back an in-progress claim. Fenced on the token shown when the list page was
  loaded (every row of the list posts the token it displayed): if the claim was taken over,
  recorded or claimed again since, nothing changes and the page says so.
* **forget**: forgets a done or failed outcome, so the next attempt runs the body again, fenced
  the same way.

Both call :mod:`celery_idem.contrib.ops`, the implementation the ``celery idem release`` and ``celery
idem forget`` commands share.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db import router
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html

from ...config import settings
from ...exceptions import StoreUnavailable
from ...records import Record, State
from .. import ops
from .models import IdempotencyRecord
from .store import DjangoStore

__all__ = ["IdempotencyRecordAdmin"]

_SEEN = "seen_token:"
_DECODE_DESCRIPTION = "Decode the selected results (runs the result serializer)"
_DECODE_WARNING = ("Decoding runs the Celery app's result serializer on the stored bytes, in this "
                   "web process. With pickle in accept_content, a record someone planted in the "
                   "table runs its code here. Decode only records whose writers you trust.")


def _utc(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _celery_app() -> Any:
    """The current Celery app (a Django project makes its app the default one)."""
    from celery.app import app_or_default  # public: the object behind celery.current_app

    return app_or_default()


def _key_prefix() -> str:
    return settings(_celery_app()).key_prefix


def _task_of(key: str) -> str:
    """The operation of a stored key, usually the task name.

    Stored keys are ``prefix`` + ``operation[@scope]:ident``, the ident 32 hex digits (a
    derived key) or ``key=``/``key#`` and the caller's key (a per-call key, which may hold ``:``
    itself). Keys of other shapes (older per-call keys) give everything before their last ``:``.
    """
    prefix = _key_prefix()
    bare = key[len(prefix):] if key.startswith(prefix) else key
    cut = min((i for i in (bare.find(":key="), bare.find(":key#")) if i >= 0), default=-1)
    if cut < 0:
        cut = bare.rfind(":")
    namespace = bare[:cut] if cut >= 0 else bare
    return namespace.split("@", 1)[0]


def _escaped(value: Any) -> str:
    return "-" if value is None else ops.printable(value)


def _column(field: str, description: str, show: Callable[[Any], str] = _escaped,
            ordering: str | None = None) -> Callable[[Any, IdempotencyRecord], str]:
    """A list or detail column: ``show`` of the row's ``field``."""
    def column(self: Any, obj: IdempotencyRecord) -> str:
        return show(getattr(obj, field))
    admin.display(description=description, ordering=ordering)(column)  # sets its attributes
    return column


def _operator(request: HttpRequest) -> ops.Operator:
    """The admin user as the operator, with the reason typed on the confirmation page."""
    name = request.user.get_username()
    return ops.Operator.here(f"admin:{name}", request.POST.get("idem_reason"), user=name)


class TaskFilter(admin.SimpleListFilter):  # type: ignore[misc]
    """Filter by task (the key's operation), among the operations of up to 1000 records."""

    title = "task"
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        keys = model_admin.get_queryset(request).values_list("key", flat=True)[:1000]
        return [(name, name) for name in sorted({_task_of(k) for k in keys})]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        if not self.value():
            return queryset
        # Unscoped keys are "<operation>:...", scoped ones "<operation>@<scope>:...".
        head = f"{_key_prefix()}{self.value()}"
        return queryset.filter(Q(key__startswith=f"{head}:") | Q(key__startswith=f"{head}@"))


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Read-mostly admin of ``celery_idem_records`` with fenced release and forget actions."""

    list_display = ("key_shown", "task", "state", "token_seen", "owner_shown", "updated_at",
                    "expires_at")
    list_filter = ("state", TaskFilter)
    search_fields = ("key",)
    ordering = ("-updated",)
    actions = ("release_claims", "forget_outcomes", "decode_results")
    fields = ("key_shown", "task", "state", "token", "owner_shown", "task_id_shown", "attempt",
              "lease", "updated_at", "expires_at", "payload_hash_shown", "claim_id",
              "content_type_shown", "stored_value")
    readonly_fields = fields
    list_per_page = 50

    # -- read-only -----------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a deleted row loses its token; forget keeps it (a RELEASED tombstone)

    def get_actions(self, request: HttpRequest) -> Any:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    # -- columns -------------------------------------------------------------------------------

    # Stored strings are shown escaped: HTML escaping (Django's) stops markup, not an ANSI
    # sequence or a bidi override that makes one key read as another.
    key_shown = _column("key", "key", ordering="key")
    owner_shown = _column("owner", "owner", ordering="owner")
    task_id_shown = _column("task_id", "task id")
    payload_hash_shown = _column("payload_hash", "payload hash")
    content_type_shown = _column("content_type", "content type")
    updated_at = _column("updated", "updated", _utc, ordering="updated")
    expires_at = _column("expires", "expires", _utc, ordering="expires")
    lease = _column("lease_expires", "lease expires", _utc)

    @admin.display(description="task")
    def task(self, obj: IdempotencyRecord) -> str:
        return ops.printable(_task_of(obj.key))

    @admin.display(description="token", ordering="token")
    def token_seen(self, obj: IdempotencyRecord) -> str:
        # The token as the page shows it, posted back with an action: the fence of release and
        # forget is the token the operator saw, not the one the action later reads.
        return str(format_html('{}<input type="hidden" name="{}{}" value="{}">',
                               obj.token, _SEEN, obj.key, obj.token))

    @admin.display(description="result / error")
    def stored_value(self, obj: IdempotencyRecord) -> str:
        """A failed record's error (celery_idem's JSON, read without running any serializer);
        for a done record, only the size and content type of its result (never decoded here)."""
        rec = self._record_of(obj)
        if rec is None:
            return "-"
        doc, summary = ops.outcome(rec)  # decode=False: only the error JSON is read
        if doc.get("error"):
            return ops.printable(f"{doc['error']['type']}: {doc['error']['message']}")
        if rec.state is State.DONE:
            return (f"not decoded: {doc['result_bytes']} bytes of "
                    f"{ops.printable(rec.content_type or 'unknown type')}. To see the value, "
                    f"select the record in the list and run the action \"{_DECODE_DESCRIPTION}\" "
                    f"(it runs the app's result serializer on the stored bytes).")
        return summary

    # -- the store behind the actions -----------------------------------------------------------

    def _store(self) -> DjangoStore:
        # The full stored key, whatever the app's prefix: the admin works on table rows.
        return DjangoStore(router.db_for_write(IdempotencyRecord), prefix="")

    def _record_of(self, obj: IdempotencyRecord) -> Record | None:
        if obj.state not in (State.DONE.value, State.FAILED.value):
            return None
        data = obj.data
        return Record(key=obj.key, state=State(obj.state), token=int(obj.token),
                      content_type=obj.content_type, data=None if data is None else bytes(data))

    # -- actions -------------------------------------------------------------------------------

    @admin.action(description=_DECODE_DESCRIPTION, permissions=["change"])
    def decode_results(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        """Decode the selected done records' results, after a confirmation page that warns.

        Decoding runs the Celery app's result serializer on the stored bytes, in this web
        process: with pickle in ``accept_content``, a record planted in the table runs its code.
        Hence an action (a POST, CSRF-protected, change permission) and never a page view.
        """
        objs = list(queryset)
        if request.POST.get("confirmed") != "yes":
            return self._confirm_page(
                request, objs, verb="decode", action="decode_results", reason=False,
                question="Decode the stored results of these records with the Celery app's "
                         "result serializer?",
                warning=_DECODE_WARNING)
        conf = _celery_app().conf
        accept = conf.result_accept_content or conf.accept_content
        operator = _operator(request)
        rows: list[dict[str, Any]] = []
        for obj in objs:
            rec = self._record_of(obj)
            if rec is None or rec.state is not State.DONE:
                rows.append({"key": ops.printable(obj.key), "content_type": "-", "size": "-",
                             "value": f"not a done record ({ops.printable(obj.state)}): no result"})
                continue
            # Logged before decoding: if the payload takes the process down, the line is there.
            ops.audit("decoded", operator, key=obj.key, token=rec.token,
                      content_type=rec.content_type, bytes=len(rec.data or b""))
            doc, summary = ops.outcome(rec, conf.result_serializer, accept, decode=True)
            if "result" in doc and doc.get("result_error") is None:
                value = ops.printable(json.dumps(doc["result"], indent=2, default=repr))
            else:
                value = summary
            rows.append({"key": ops.printable(obj.key), "value": value,
                         "content_type": ops.printable(rec.content_type or "-"),
                         "size": len(rec.data or b"")})
        self.message_user(request, _DECODE_WARNING, messages.WARNING)
        return TemplateResponse(request, "admin/celery_idem/decoded.html", {
            **self.admin_site.each_context(request),
            "opts": self.model._meta, "title": "Decoded results", "rows": rows,
        })

    @admin.action(description="Release the selected in-progress claims", permissions=["change"])
    def release_claims(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        return self._fenced_action(
            request, queryset, verb="release", action="release_claims",
            run=ops.release_claim,
            question="Release these claims? The next attempt of each action runs the body.",
            warning="A claim whose lease is live may still be running its body: after the "
                    "release a duplicate can run it again, and the holder's record is refused.")

    @admin.action(description="Forget the selected done or failed outcomes", permissions=["change"])
    def forget_outcomes(self, request: HttpRequest, queryset: Any) -> HttpResponse | None:
        return self._fenced_action(
            request, queryset, verb="forget", action="forget_outcomes",
            run=ops.forget_outcome,
            question="Forget these outcomes? The next attempt of each action runs the body again.",
            warning="Duplicates of these actions are no longer answered from the record.")

    def _fenced_action(self, request: HttpRequest, queryset: Any, *, verb: str, action: str,
                       run: Any, question: str, warning: str) -> HttpResponse | None:
        seen = {k[len(_SEEN):]: v for k, v in request.POST.items() if k.startswith(_SEEN)}
        objs = list(queryset)
        if request.POST.get("confirmed") != "yes":
            return self._confirm_page(request, objs, verb=verb, action=action, question=question,
                                      warning=warning, seen=seen)
        store = self._store()
        operator = _operator(request)
        past = "released" if verb == "release" else "forgotten"
        for obj in objs:
            token = seen.get(obj.key)
            shown = ops.printable(obj.key)
            try:
                rec = run(store, obj.key, int(token) if token is not None else None, by=operator)
            except (ops.Refused, StoreUnavailable) as exc:
                self.message_user(request, f"{shown}: {ops.printable(exc)}", messages.ERROR)
                continue
            failed = ops.send_operator_event(_celery_app(), past, operator, key=obj.key,
                                             token=rec.token, task_id=rec.task_id)
            if failed is not None:
                self.message_user(request, f"{shown}: the {ops.OPERATOR_EVENT_TYPE} event was not "
                                           f"sent ({failed})", messages.WARNING)
            reason = f"; reason: {operator.reason}" if operator.reason else ""
            self.log_change(request, obj, ops.printable(
                f"{past} (token {rec.token}, task {rec.task_id or '-'}){reason}"))
            self.message_user(request, f"{shown}: {past} (token {rec.token}); the next attempt "
                                       f"claims it with token above {rec.token}", messages.SUCCESS)
        return None

    def _confirm_page(self, request: HttpRequest, objs: list[Any], *, verb: str, action: str,
                      question: str, warning: str, seen: dict[str, str] | None = None,
                      reason: bool = True) -> HttpResponse:
        """The confirmation page of an action: the records (escaped), the question, a reason."""
        seen = seen or {}
        rows = [{"key": o.key, "key_shown": ops.printable(o.key), "state": ops.printable(o.state),
                 "token": o.token, "seen": seen.get(o.key, o.token),
                 "task_id": ops.printable(o.task_id), "owner": ops.printable(o.owner)}
                for o in objs]
        return TemplateResponse(request, "admin/celery_idem/confirm_action.html", {
            **self.admin_site.each_context(request),
            "opts": self.model._meta, "title": f"{verb.capitalize()} records", "rows": rows,
            "question": question, "warning": warning, "verb": verb, "action": action,
            "reason": reason, "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        })
