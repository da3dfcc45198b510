"""A text column that compares byte for byte on every database, like the SQL store's."""

from __future__ import annotations

from typing import Any

from django.db import models

from ...stores.base import mysql_byte_collation


class KeyTextField(models.CharField):  # type: ignore[misc]
    """A ``VARCHAR`` with the NO PAD binary collation on MySQL/MariaDB.

    MySQL's default collations are case- and accent-insensitive (``Refund:ab`` and
    ``refund:ab`` would be one primary key), and its ``_bin`` ones ignore trailing spaces.
    :func:`celery_idem.stores.sql.text_type` gives the same columns the same collation, so a
    table made by either path serves both. Other databases compare bytes already and get no
    collation clause.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params: dict[str, Any] = super().db_parameters(connection)
        if connection.vendor == "mysql":
            params["collation"] = byte_collation(connection)
        return params


def byte_collation(connection: Any) -> str:
    """The byte-for-byte collation of a MySQL/MariaDB ``connection``."""
    return mysql_byte_collation(connection.mysql_is_mariadb, connection.mysql_version)
