"""Moved to :mod:`celery_idem.contrib.maintenance`; this old import path is kept as the same module.

``import celery_idem.maintenance`` gives the module object of ``celery_idem.contrib.maintenance`` (so a patch
of one is a patch of the other); the star import is for type checkers.
"""

from __future__ import annotations

import sys

from .contrib import maintenance as _moved
from .contrib.maintenance import *  # noqa: F403

sys.modules[__name__] = _moved
