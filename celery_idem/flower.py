"""Moved to :mod:`celery_idem.contrib.flower`; this old import path is kept as the same module.

``import celery_idem.flower`` gives the module object of ``celery_idem.contrib.flower`` (so a patch
of one is a patch of the other); the star import is for type checkers.
"""

from __future__ import annotations

import sys

from .contrib import flower as _moved
from .contrib.flower import *  # noqa: F403

sys.modules[__name__] = _moved
