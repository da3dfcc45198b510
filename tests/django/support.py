"""Django set up once per test process: a SQLite file and a PostgreSQL database of its own.

``configure()`` creates a PostgreSQL database ``celery_idem_django_test_<random>`` (dropped by
``teardown()``), points ``DATABASES`` at it (alias ``pg``) and at a SQLite file in a private
temporary directory (alias ``default``), calls ``django.setup()`` and migrates both. Worker
processes get the same settings through :func:`worker_env` (``DJANGO_SETTINGS_MODULE`` =
``tests.django.worker_settings``, which reads the names from the environment).

Django settings are process-wide and can be configured once: every test in one process shares
these two databases, and the tests keep apart by key prefix (each test's own).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import IN_CI, MYSQL_URL, PG_URL, _answers, require

_state: dict[str, Any] = {}

#: The apps of the test process and of the workers (tests/django/worker_settings.py).
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.admin",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "celery_idem.contrib.django",
    "tests.django.shop",
]


def pg_params() -> dict[str, Any]:
    """Host, port and user of the test PostgreSQL server (from CELERY_IDEM_TEST_PG)."""
    parts = urlsplit(PG_URL.replace("postgresql+psycopg", "postgresql"))
    return {"HOST": parts.hostname or "127.0.0.1", "PORT": str(parts.port or 5432),
            "USER": parts.username or "root", "PASSWORD": parts.password or ""}


def _admin_sql(sql: str) -> None:
    import psycopg

    p = pg_params()
    with psycopg.connect(host=p["HOST"], port=p["PORT"], user=p["USER"], password=p["PASSWORD"] or None,
                         dbname=urlsplit(PG_URL).path.lstrip("/") or "postgres",
                         autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


def mysql_params() -> dict[str, Any]:
    """Host, port and user of the test MariaDB/MySQL server (from CELERY_IDEM_TEST_MYSQL)."""
    parts = urlsplit(MYSQL_URL.replace("mysql+pymysql", "mysql"))
    return {"HOST": parts.hostname or "127.0.0.1", "PORT": str(parts.port or 3306),
            "USER": parts.username or "root", "PASSWORD": parts.password or ""}


def mysqldb_shim() -> None:
    """Django's MySQL backend imports ``MySQLdb`` (mysqlclient); the dev venv has PyMySQL.

    PyMySQL's documented stand-in, with the version Django asks of mysqlclient: the tests talk
    to the server through PyMySQL, the statements are the ones mysqlclient would send.
    """
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        import pymysql

        pymysql.version_info = (2, 2, 1, "final", 0)
        pymysql.install_as_MySQLdb()


def _mysql_admin_sql(sql: str) -> None:
    import pymysql

    p = mysql_params()
    conn = pymysql.connect(host=p["HOST"], port=int(p["PORT"]), user=p["USER"], password=p["PASSWORD"],
                           connect_timeout=5, autocommit=True)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql)
    finally:
        conn.close()


def databases(sqlite_path: str, pg_name: str | None, mysql_name: str | None = None) -> dict[str, Any]:
    """The DATABASES setting for the test databases (PostgreSQL only when it answers)."""
    dbs: dict[str, Any] = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sqlite_path,
            # Several worker processes share the file: wait for the write lock (the claim
            # takes it with BEGIN IMMEDIATE) instead of failing at once; WAL lets readers run.
            "OPTIONS": {"timeout": 30, "init_command": "PRAGMA journal_mode=WAL;"},
        },
    }
    if pg_name:
        dbs["pg"] = {"ENGINE": "django.db.backends.postgresql", "NAME": pg_name, **pg_params()}
    if mysql_name:
        mysqldb_shim()
        dbs["mysql"] = {"ENGINE": "django.db.backends.mysql", "NAME": mysql_name, **mysql_params(),
                        "OPTIONS": {"charset": "utf8mb4"}}
    return dbs


def configure() -> dict[str, Any]:
    """Set Django up for this process (once); return its names: sqlite path, pg database."""
    if _state:
        return _state
    import django
    from django.conf import settings
    from django.core.management import call_command

    require(PG_URL, 5432, "PostgreSQL")
    tmp = tempfile.mkdtemp(prefix="celery_idem_django_")
    sqlite_path = os.path.join(tmp, "db.sqlite3")
    pg_name = f"celery_idem_django_test_{uuid.uuid4().hex[:10]}"
    _admin_sql(f'CREATE DATABASE "{pg_name}"')
    # MariaDB/MySQL only where it answers (its contract tests skip otherwise, fail in CI).
    mysql_name = None
    if _answers(MYSQL_URL, 3306):
        mysql_name = f"celery_idem_django_test_{uuid.uuid4().hex[:10]}"
        _mysql_admin_sql(f"CREATE DATABASE `{mysql_name}` CHARACTER SET utf8mb4")
    _state.update(sqlite=sqlite_path, pg=pg_name, mysql=mysql_name, tmp=tmp)
    settings.configure(
        SECRET_KEY="celery-idem-tests",
        INSTALLED_APPS=INSTALLED_APPS,
        DATABASES=databases(sqlite_path, pg_name, mysql_name),
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        # The admin's system checks want these; the test process serves no page.
        MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                    "django.contrib.auth.middleware.AuthenticationMiddleware",
                    "django.contrib.messages.middleware.MessageMiddleware"],
        TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
                    "OPTIONS": {"context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages"]}}],
    )
    django.setup()
    for alias in ("default", "pg", *(["mysql"] if mysql_name else [])):
        call_command("migrate", database=alias, verbosity=0)
    return _state


def teardown() -> None:
    """Close this process's connections and drop the PostgreSQL database."""
    if not _state:
        return
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        conn.close()
    # WITH (FORCE): a worker the test could not stop may still hold a connection.
    _admin_sql(f'DROP DATABASE IF EXISTS "{_state["pg"]}" WITH (FORCE)')
    if _state.get("mysql"):
        _mysql_admin_sql(f"DROP DATABASE IF EXISTS `{_state['mysql']}`")
    _state.clear()


def worker_env(alias: str) -> dict[str, str]:
    """Environment for a subprocess (a worker, manage.py) that uses the same databases."""
    state = configure()
    return {
        "DJANGO_SETTINGS_MODULE": "tests.django.worker_settings",
        "CELERY_IDEM_DJANGO_SQLITE": state["sqlite"],
        "CELERY_IDEM_DJANGO_PG": state["pg"],
        "CELERY_IDEM_DJANGO_MYSQL": state.get("mysql") or "",
        "CELERY_IDEM_DJANGO_ALIAS": alias,
    }


def require_mysql() -> None:
    """Skip (locally) or fail (CI) when the session has no MariaDB/MySQL database."""
    if not configure().get("mysql"):
        message = f"MariaDB/MySQL at {MYSQL_URL} does not answer"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def django_databases() -> Any:
    """Django configured with both test databases for the session; the PG one dropped after."""
    state = configure()
    yield state
    teardown()
