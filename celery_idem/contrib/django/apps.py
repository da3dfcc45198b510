"""The Django app config: label ``celery_idem``, worker connection hygiene on ready."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryIdemConfig(AppConfig):  # type: ignore[misc]
    """``celery_idem.contrib.django`` in ``INSTALLED_APPS``; its label is ``celery_idem``."""

    name = "celery_idem.contrib.django"
    label = "celery_idem"
    verbose_name = "Idempotency records"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Connected here as well as when a store is built: a worker that never builds the
        # store in the parent (it is built lazily) still closes inherited connections.
        from .lifecycle import install_worker_signals

        install_worker_signals()
