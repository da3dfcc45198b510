"""The Django integration: records and receipts in the Django database, through Django's connections.

Add ``"celery_idem.contrib.django"`` to ``INSTALLED_APPS`` (app label ``celery_idem``) and run
``manage.py migrate``: it creates ``celery_idem_records`` and ``celery_idem_receipts``, the
tables the SQLAlchemy store uses, with the same columns. Then either keep
``result_backend = "django-db"`` (django-celery-results) or set
``idempotency_store = "django://"`` (``"django://<alias>"`` for another ``DATABASES`` entry).
See docs/django.md.
"""
