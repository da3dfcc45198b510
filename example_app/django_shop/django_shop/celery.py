"""The project's Celery app: settings from Django's (``CELERY_*``), tasks from the apps."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_shop.settings")

app = Celery("django_shop")
# CELERY_RESULT_BACKEND = "django-db" in settings.py: django-celery-results keeps the results,
# and celery_idem keeps its records in the same database, through Django's connection.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
