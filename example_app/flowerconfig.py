"""Flower's configuration for docker-compose.yml's ``flower`` service (``--conf``).

Flower reads this file before it builds its event state; the extension then shows each
idempotency decision on the task page and counts it in ``/metrics`` (docs/operations.md).
"""

import celery_idem.contrib.flower

celery_idem.contrib.flower.install()
