"""Settings of the django_shop example.

The database is the embedded SQLite file ``db.sqlite3`` next to manage.py unless
``DJANGO_SHOP_DATABASE`` names a PostgreSQL one (``postgresql://user@host:5432/name``).
The broker is ``CELERY_BROKER_URL`` (default: Redis on 127.0.0.1:6379, database 0).
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "django-shop-example-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",  # result_backend = "django-db"
    "celery_idem.contrib.django",  # the records and receipts tables, and their admin
    "shop",
]

_url = os.environ.get("DJANGO_SHOP_DATABASE", "")
if _url.startswith(("postgresql://", "postgres://")):
    _p = urlsplit(_url)
    DATABASES = {"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": _p.path.lstrip("/"),
        "USER": _p.username or "", "PASSWORD": _p.password or "", "HOST": _p.hostname or "",
        "PORT": str(_p.port or 5432),
    }}
else:
    DATABASES = {"default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJANGO_SHOP_SQLITE", str(BASE_DIR / "db.sqlite3")),
        # Worker processes share the file: wait for its write lock rather than fail at once,
        # and let readers run beside the writer (WAL).
        "OPTIONS": {"timeout": 30, "init_command": "PRAGMA journal_mode=WAL;"},
    }}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = "django-db"  # also selects celery_idem's Django store
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DJANGO_SHOP_QUEUE", "django_shop")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

ROOT_URLCONF = "django_shop.urls"
STATIC_URL = "/static/"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
