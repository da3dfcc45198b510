"""MySQL/MariaDB: the text columns take the NO PAD binary collation (``K`` and ``K `` are two keys)."""

from typing import Any

from django.db import migrations

from celery_idem.contrib.django.fields import KeyTextField, byte_collation


def byte_for_byte(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return  # the other databases compare bytes already
    collation = byte_collation(connection)
    for name in ("IdempotencyRecord", "IdempotencyReceipt"):
        model = apps.get_model("celery_idem", name)
        table = model._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
                "AND TABLE_NAME = %s AND COLLATION_NAME IS NOT NULL AND COLLATION_NAME <> %s",
                [table, collation])
            stale = {row[0] for row in cursor.fetchall()}
        changes = [
            f"MODIFY COLUMN {schema_editor.quote_name(field.column)} VARCHAR({field.max_length}) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} {'NULL' if field.null else 'NOT NULL'}"
            for field in model._meta.local_fields
            if isinstance(field, KeyTextField) and field.column in stale
        ]
        if changes:
            schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} {', '.join(changes)}")


class Migration(migrations.Migration):

    dependencies = [("celery_idem", "0001_initial")]

    # MySQL cannot roll DDL back: Django refuses it inside a transaction.
    operations = [migrations.RunPython(byte_for_byte, migrations.RunPython.noop, atomic=False)]
