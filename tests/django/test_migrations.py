"""The app's migrations bring a table made by an earlier version to the current schema."""

from __future__ import annotations

from typing import Any

from tests.django.support import django_databases, require_mysql  # noqa: F401 - a fixture used by name


def _collations(connection: Any, table: str) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
                       "DATABASE() AND TABLE_NAME = %s AND COLLATION_NAME IS NOT NULL", [table])
        return {row[0] for row in cursor.fetchall()}


def test_a_mariadb_table_with_a_trailing_space_blind_collation_migrates_to_the_byte_for_byte_one(
    django_databases: Any,  # noqa: F811
) -> None:
    require_mysql()
    from django.core.management import call_command
    from django.db import connections

    from celery_idem.contrib.django.store import DjangoStore

    connection = connections["mysql"]
    # The tables as the first migration made them before: utf8mb4_bin, blind to trailing spaces
    call_command("migrate", "celery_idem", "0001", database="mysql", verbosity=0)
    with connection.cursor() as cursor:
        for table in ("celery_idem_records", "celery_idem_receipts"):
            cursor.execute(f"ALTER TABLE {table} MODIFY COLUMN `key` VARCHAR(255) CHARACTER SET "
                           f"utf8mb4 COLLATE utf8mb4_bin NOT NULL")
    assert "utf8mb4_bin" in _collations(connection, "celery_idem_records")
    call_command("migrate", "celery_idem", database="mysql", verbosity=0)
    for table in ("celery_idem_records", "celery_idem_receipts"):
        assert _collations(connection, table) == {"utf8mb4_nopad_bin"}, table
    store = DjangoStore.from_url("django://mysql", prefix="migrated:")
    first = store.claim("K", owner="o", task_id="t1", attempt=0, lease=30, ttl=60)
    second = store.claim("K ", owner="o", task_id="t2", attempt=0, lease=30, ttl=60)
    assert (first.status.value, second.status.value) == ("claimed", "claimed")
