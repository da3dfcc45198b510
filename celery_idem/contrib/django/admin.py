"""The records in the Django admin: read-mostly, with the CLI's two repairs as actions.

The list shows key, task, state, token, owner, updated and expires, filters on state and task,
and searches by key; a record's page shows its decoded result or error. Nothing is editable,
added or deleted through the admin. Two actions, each with a confirmation page and each logged
(the ``celery_idem`` logger at WARNING, and the admin's own history):

* **release**: gives back an in-progress claim. Fenced on the token shown when the list page was
  loaded (every row of the list posts the token it displayed): if the claim was taken over,
  recorded or claimed again since, nothing changes and the page says so.
* **forget**: forgets a done or failed outcome, so the next attempt runs the body again, fenced
  the same way.

Both call :mod:`celery_idem.ops`, the implementation the ``celery idem release`` and ``celery
idem forget`` commands share.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db import router
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.html import format_html

from ... import ops
from ...exceptions import StoreUnavailable
from ...records import Record, State
from .models import IdempotencyRecord
from .store import DjangoStore

__all__ = ["IdempotencyRecordAdmin"]

_SEEN = "seen_token:"


def _utc(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _celery_conf() -> Any:
    """The current Celery app's settings (a Django project makes its app the default one)."""
    from celery import current_app

    return current_app.conf


def _key_prefix() -> str:
    return str(_celery_conf().get("idempotency_key_prefix") or "celery-idem:")


def _task_of(key: str) -> str:
    """The operation of a stored key (``prefix`` + ``operation:hash``), usually the task name."""
    prefix = _key_prefix()
    bare = key[len(prefix):] if key.startswith(prefix) else key
    return bare.rsplit(":", 1)[0] if ":" in bare else bare


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
        return queryset.filter(key__startswith=f"{_key_prefix()}{self.value()}:")


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Read-mostly admin of ``celery_idem_records`` with fenced release and forget actions."""

    list_display = ("key", "task", "state", "token_seen", "owner", "updated_at", "expires_at")
    list_filter = ("state", TaskFilter)
    search_fields = ("key",)
    ordering = ("-updated",)
    actions = ("release_claims", "forget_outcomes")
    fields = ("key", "task", "state", "token", "owner", "task_id", "attempt", "lease",
              "updated_at", "expires_at", "payload_hash", "claim_id", "content_type", "outcome")
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

    @admin.display(description="task")
    def task(self, obj: IdempotencyRecord) -> str:
        return _task_of(obj.key)

    @admin.display(description="token", ordering="token")
    def token_seen(self, obj: IdempotencyRecord) -> str:
        # The token as the page shows it, posted back with an action: the fence of release and
        # forget is the token the operator saw, not the one the action later reads.
        return str(format_html('{}<input type="hidden" name="{}{}" value="{}">',
                               obj.token, _SEEN, obj.key, obj.token))

    @admin.display(description="updated", ordering="updated")
    def updated_at(self, obj: IdempotencyRecord) -> str:
        return _utc(obj.updated)

    @admin.display(description="expires", ordering="expires")
    def expires_at(self, obj: IdempotencyRecord) -> str:
        return _utc(obj.expires)

    @admin.display(description="lease expires")
    def lease(self, obj: IdempotencyRecord) -> str:
        return _utc(obj.lease_expires)

    @admin.display(description="result / error")
    def outcome(self, obj: IdempotencyRecord) -> str:
        rec = self._record_of(obj)
        if rec is None:
            return "-"
        conf = _celery_conf()
        doc, summary = ops.outcome(rec, conf.result_serializer,
                                   conf.result_accept_content or conf.accept_content)
        if doc.get("error"):
            return f"{doc['error']['type']}: {doc['error']['message']}"
        if "result" in doc:
            import json

            return json.dumps(doc["result"], indent=2, default=repr)
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
            rows = [{"key": o.key, "state": o.state, "token": o.token,
                     "seen": seen.get(o.key, o.token), "task_id": o.task_id, "owner": o.owner}
                    for o in objs]
            return TemplateResponse(request, "admin/celery_idem/confirm_action.html", {
                **self.admin_site.each_context(request),
                "opts": self.model._meta, "title": f"{verb.capitalize()} records", "rows": rows,
                "question": question, "warning": warning, "verb": verb, "action": action,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            })
        store = self._store()
        by = f"admin:{request.user.get_username()}"
        for obj in objs:
            token = seen.get(obj.key)
            try:
                rec = run(store, obj.key, int(token) if token is not None else None, by=by)
            except ops.Refused as refused:
                self.message_user(request, f"{obj.key}: {refused}", messages.ERROR)
                continue
            except StoreUnavailable as exc:
                self.message_user(request, f"{obj.key}: {exc}", messages.ERROR)
                continue
            past = "released" if verb == "release" else "forgotten"
            self.log_change(request, obj, f"{past} (token {rec.token}, task {rec.task_id or '-'})")
            self.message_user(request, f"{obj.key}: {past} (token {rec.token}); the next attempt "
                                       f"claims it with token above {rec.token}", messages.SUCCESS)
        return None
