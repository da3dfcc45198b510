"""Results encoded as kombu's JSON serializer encodes them, with one encoder built once.

An acceleration (see :mod:`celery_idem.accel`) at ``KombuCodec.encode_result``, whose plain path
is ``kombu.serialization.dumps``. kombu's registry entry for ``"json"`` calls ``json.dumps`` with
kombu's ``JSONEncoder`` class, building an encoder per call; one encoder built here writes the
same bytes for a third of the CPU (the gate's per-task budget, docs/benchmarks.md). It applies
only while the registry still holds kombu's own entry (kombu's private ``registry._encoders``,
listed in ``celery_idem.accel.PRIVATE_NAMES``): a serializer registered under ``"json"`` later
(kombu's ``register()``) is used as it is, through the registry.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JsonShortcut", "json_shortcut"]


class JsonShortcut:
    """kombu's ``"json"`` serializer with its encoder built once.

    Args:
        registry: kombu's serializer registry.
        entry: Its ``"json"`` entry, kombu's own.
        failed: The exception an encoding error is raised as (kombu's ``EncodeError``).
    """

    def __init__(self, registry: Any, entry: Any, failed: type[Exception]) -> None:
        from kombu.utils import json as kombu_json

        self._encoders: dict[str, Any] = registry._encoders
        self._entry = entry
        self._encode = kombu_json.JSONEncoder().encode
        self._failed = failed
        self.content_type = f"{entry.content_type};{entry.content_encoding}"
        self._charset = entry.content_encoding

    def applies(self) -> bool:
        """Whether the registry's ``"json"`` is still kombu's own entry."""
        return self._encoders.get("json") is self._entry

    def encode(self, value: Any) -> bytes:
        """``value`` as the registry's ``"json"`` writes it."""
        try:
            return self._encode(value).encode(self._charset)
        except Exception as exc:  # as kombu's registry reports it (_reraise_errors)
            raise self._failed(exc) from exc


def json_shortcut(serialization: Any, failed: type[Exception]) -> JsonShortcut | None:
    """The shortcut for kombu's ``serialization`` module, or None when it cannot apply.

    None when the registry has no private ``_encoders`` (another kombu) or its ``"json"`` entry
    is not kombu's own: the codec then encodes through ``serialization.dumps``.
    """
    from kombu.utils import json as kombu_json

    encoders = getattr(serialization.registry, "_encoders", None)
    entry = encoders.get("json") if isinstance(encoders, dict) else None
    if entry is None or getattr(entry, "encoder", None) is not kombu_json.dumps:
        return None
    return JsonShortcut(serialization.registry, entry, failed)
