"""A text column that compares byte for byte on every database, like the SQL store's."""

from __future__ import annotations

from typing import Any

from django.db import models


class KeyTextField(models.CharField):  # type: ignore[misc]
    """A ``VARCHAR`` with the binary collation ``utf8mb4_bin`` on MySQL/MariaDB.

    MySQL's default collations are case- and accent-insensitive: ``Refund:ab`` and
    ``refund:ab`` would be one primary key. celery_idem/stores/sql.py gives the same columns the
    same collation, so a table made by either path serves both. Other databases compare bytes
    already and get no collation clause.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params: dict[str, Any] = super().db_parameters(connection)
        if connection.vendor == "mysql":
            params["collation"] = "utf8mb4_bin"
        return params
