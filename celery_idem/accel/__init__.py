"""The SQL store's fast paths (psycopg's connection, Celery's result row in the record's statement)."""
