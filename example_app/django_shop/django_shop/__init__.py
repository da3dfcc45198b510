"""The django_shop project: importing it loads the Celery app, as Celery's Django guide does."""

from .celery import app as celery_app

__all__ = ["celery_app"]
