"""MySQL/MariaDB: the text columns take the NO PAD binary collation (``K`` and ``K `` are two keys)."""

from typing import Any

from django.db import migrations

from celery_idem.contrib.django.fields import byte_collation
from celery_idem.contrib.django.models import RECEIPTS_TABLE, RECORDS_TABLE


def byte_for_byte(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return  # the other databases compare bytes already
    collation = byte_collation(connection)
    for table in (RECORDS_TABLE, RECEIPTS_TABLE):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COLUMN_NAME, CHARACTER_MAXIMUM_LENGTH, IS_NULLABLE FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND DATA_TYPE = 'varchar' "
                "AND COLLATION_NAME <> %s", [table, collation])
            stale = cursor.fetchall()
        changes = [
            f"MODIFY COLUMN {schema_editor.quote_name(name)} VARCHAR({length}) CHARACTER SET utf8mb4 "
            f"COLLATE {collation} {'NULL' if nullable == 'YES' else 'NOT NULL'}"
            for name, length, nullable in stale
        ]
        if changes:
            schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} {', '.join(changes)}")


class Migration(migrations.Migration):

    dependencies = [("celery_idem", "0001_initial")]

    # MySQL cannot roll DDL back: Django refuses it inside a transaction.
    operations = [migrations.RunPython(byte_for_byte, migrations.RunPython.noop, atomic=False)]
