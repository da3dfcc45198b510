"""The records and receipts tables as Django models, column for column as the SQL store has them.

The models exist for migrations and the admin; the store and the receipts never write through
the ORM (each verb is one conditional statement, see :mod:`.store`). The table, column and type
choices match :func:`celery_idem.stores.sql.records_table` and
:func:`celery_idem.contrib.receipts.receipts_table`: ``VARCHAR(255)`` keys (binary collation on MySQL),
``BIGINT`` tokens, ``DOUBLE`` clock values (epoch seconds, database clock) and ``BYTEA`` /
``LONGBLOB`` / ``BLOB`` data. A table made by either path is used as it is by the other
(``migrate celery_idem --fake-initial`` adopts tables SQLAlchemy created).
"""

from __future__ import annotations

from django.db import models

from ..ops import printable
from .fields import KeyTextField

RECORDS_TABLE = "celery_idem_records"
RECEIPTS_TABLE = "celery_idem_receipts"
INTENTS_TABLE = f"{RECORDS_TABLE}_intents"
WATERMARKS_TABLE = f"{RECORDS_TABLE}_watermarks"


class IdempotencyRecord(models.Model):  # type: ignore[misc]
    """One key's record: who holds it, its fencing token, its outcome (see records.Record)."""

    key = KeyTextField(max_length=255, primary_key=True)
    state = KeyTextField(max_length=16)
    token = models.BigIntegerField()
    owner = KeyTextField(max_length=255)
    task_id = KeyTextField(max_length=255)
    attempt = models.IntegerField()
    lease_expires = models.FloatField(null=True)
    payload_hash = KeyTextField(max_length=255, null=True)
    content_type = KeyTextField(max_length=255, null=True)
    data = models.BinaryField(null=True)
    updated = models.FloatField()
    expires = models.FloatField()
    claim_id = KeyTextField(max_length=64, null=True)

    class Meta:
        db_table = RECORDS_TABLE
        # The SQL store's index names, so the two paths make the same schema.
        indexes = [  # noqa: RUF012 - Django reads it as a class attribute
            models.Index(fields=["state"], name="ix_celery_idem_records_state"),
            models.Index(fields=["expires"], name="ix_celery_idem_records_expires"),
        ]
        verbose_name = "idempotency record"

    def __str__(self) -> str:
        # Shown by the admin (labels, history, messages): a stored key's control and bidi
        # characters escaped, as everywhere an operator reads it.
        return f"{printable(self.key)} ({printable(self.state)}, token {self.token})"


class IdempotencyReceipt(models.Model):  # type: ignore[misc]
    """A receipt: the key of an action whose transaction committed, and its result."""

    key = KeyTextField(max_length=255, primary_key=True)
    token = models.BigIntegerField()
    task_id = KeyTextField(max_length=255)
    content_type = KeyTextField(max_length=255, null=True)
    data = models.BinaryField(null=True)
    created = models.FloatField()
    expires = models.FloatField()

    class Meta:
        db_table = RECEIPTS_TABLE
        # SQLAlchemy names it ix_celery_idem_receipts_expires: 31 characters, one more than
        # Django allows an index name (models.E034). The name is all that differs.
        indexes = [  # noqa: RUF012
            models.Index(fields=["expires"], name="ix_celery_idem_receipts_exp"),
        ]
        verbose_name = "idempotency receipt"

    def __str__(self) -> str:
        return f"{printable(self.key)} (token {self.token})"


class IdempotencyIntent(models.Model):  # type: ignore[misc]
    """A message kept until its action's outcome is recorded (see records.Intent)."""

    key = KeyTextField(max_length=255, primary_key=True)
    task_id = KeyTextField(max_length=255)
    queue = KeyTextField(max_length=255)
    message = models.BinaryField()
    enqueued = models.FloatField()
    deadline = models.FloatField()
    expires = models.FloatField()
    sent = models.FloatField()

    class Meta:
        db_table = INTENTS_TABLE
        # Django allows 30 characters (models.E034): SQLAlchemy's name is longer.
        indexes = [  # noqa: RUF012
            models.Index(fields=["deadline"], name="ix_celery_idem_intents_dl"),
        ]
        verbose_name = "idempotency intent"

    def __str__(self) -> str:
        return f"{printable(self.key)} (task {printable(self.task_id)})"


class IdempotencyWatermark(models.Model):  # type: ignore[misc]
    """Per queue (the stored name), the newest enqueue time of an intent a relay saw claimed."""

    queue = KeyTextField(max_length=255, primary_key=True)
    enqueued = models.FloatField()

    class Meta:
        db_table = WATERMARKS_TABLE
        verbose_name = "idempotency watermark"

    def __str__(self) -> str:
        return f"{printable(self.queue)} ({self.enqueued})"
