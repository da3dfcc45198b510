"""The business table of the Django worker tests: one row per body that committed."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]
    """No unique constraint on ``action``: a duplicate write shows as a second row."""

    action = models.CharField(max_length=100, db_index=True)
    amount = models.IntegerField()
    task_id = models.CharField(max_length=100)
    token = models.BigIntegerField()
    pid = models.IntegerField()

    class Meta:
        app_label = "shop"
