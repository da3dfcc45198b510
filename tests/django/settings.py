"""Minimal Django settings for makemigrations and the tests that configure nothing else."""

SECRET_KEY = "celery-idem-tests"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "celery_idem.contrib.django",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
