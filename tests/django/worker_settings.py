"""Django settings of the worker processes (and ``manage.py migrate``) in tests/django.

The databases come from the environment set by :func:`tests.django.support.worker_env`:
``CELERY_IDEM_DJANGO_ALIAS=pg`` (or ``mysql``) makes the PostgreSQL (or MariaDB) test database
the ``default`` one (so ``result_backend = "django-db"`` and ``django://`` both mean it),
``sqlite`` the file.
"""

import os

from tests.django.support import INSTALLED_APPS, databases

__all__ = ["INSTALLED_APPS"]

SECRET_KEY = "celery-idem-tests"
USE_TZ = True
_dbs = databases(os.environ.get("CELERY_IDEM_DJANGO_SQLITE", ""), os.environ.get("CELERY_IDEM_DJANGO_PG"),
                 os.environ.get("CELERY_IDEM_DJANGO_MYSQL") or None)
if os.environ.get("CELERY_IDEM_DJANGO_ALIAS") in ("pg", "mysql"):
    _alias = os.environ["CELERY_IDEM_DJANGO_ALIAS"]
    _dbs = {"default": _dbs[_alias], "sqlite": _dbs["default"]}
DATABASES = _dbs
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# For the admin test (runserver with these settings).
ROOT_URLCONF = "tests.django.urls"
STATIC_URL = "/static/"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
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
