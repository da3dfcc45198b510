"""The canonical JSON encoder of idempotency keys, built once.

Not an acceleration behind the switch: :mod:`celery_idem.keys` makes key text with it, so it
must write the same text with accelerations on and off, and it is **not switched** (like
:mod:`.celery_compat`). ``json.dumps`` builds a ``JSONEncoder``, and ``encode`` its C encoder,
on every call; the C encoder (``json.encoder.c_make_encoder``, CPython's undocumented
acceleration, listed in ``celery_idem.accel.PRIVATE_NAMES``) is made here once instead, and
used only when it writes a probe exactly as the pure-Python encoder does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["make_encode"]


def make_encode() -> Callable[[Any], str]:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"))``, with its encoder built once.

    No circular-reference markers: a canonical value is built fresh by ``keys.canonical`` (a
    cyclic input fails there), so it has no cycles.

    Returns:
        The encoder: CPython's C encoder when present and equivalent, else ``JSONEncoder.encode``.
    """
    slow = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return slow.encode
    try:
        fast = make(None, slow.default, json.encoder.encode_basestring_ascii, None, ":", ",",
                    True, False, True)
        probe = {"b": [1.5, None, True], "a": "\u00e9\n", "c": {"y": 2, "x": -0.0}}
        if "".join(fast(probe, 0)) != slow.encode(probe):  # pragma: no cover
            return slow.encode
    except Exception:  # pragma: no cover - another interpreter's C encoder takes other arguments
        return slow.encode

    def encode(value: Any) -> str:
        return "".join(fast(value, 0))

    return encode
