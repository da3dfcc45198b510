"""Moved to :mod:`celery_idem.contrib.cli`; this old import path is kept as the same module.

``import celery_idem.cli`` gives the module object of ``celery_idem.contrib.cli`` (so a patch
of one is a patch of the other); the star import is for type checkers.
"""

from __future__ import annotations

import sys

from .contrib import cli as _moved
from .contrib.cli import *  # noqa: F403

sys.modules[__name__] = _moved
