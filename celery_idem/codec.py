"""Encoding of results and terminal errors for the store.

Results are encoded with the app's ``result_serializer`` and decoded only if their content type
is in ``result_accept_content`` (or ``accept_content``): pickle is never unpickled by an app that
does not accept it. Terminal errors are stored as JSON ``{"module", "type", "message"}`` and
re-raised as the same type when its module is already imported, else as :class:`TerminalError`
naming it: a record never makes a worker import a module. kombu is imported by :class:`KombuCodec`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection
from typing import Any, Protocol

from .exceptions import CorruptRecord, TerminalError

__all__ = ["ERROR_CONTENT_TYPE", "Codec", "KombuCodec"]

ERROR_CONTENT_TYPE = "application/x-celery-idem-error+json"


class Codec(Protocol):
    """How the gate turns results and errors into bytes and back."""

    def encode_result(self, value: Any) -> tuple[str, bytes]:
        """Return ``(content_type, data)``; raise if the value cannot be encoded."""

    def decode_result(self, key: str, content_type: str, data: bytes) -> Any:
        """Return the value; raise CorruptRecord if the data is unreadable or not accepted."""

    def encode_error(self, exc: BaseException) -> tuple[str, bytes]:
        """Return ``(content_type, data)`` describing a terminal error."""

    def decode_error(self, key: str, content_type: str, data: bytes) -> BaseException:
        """Return an exception of the same type and message as the recorded one."""


def encode_error(exc: BaseException) -> tuple[str, bytes]:
    """Describe ``exc`` as JSON: its module, qualified type name and message."""
    cls = type(exc)
    doc = {"module": cls.__module__, "type": cls.__qualname__, "message": str(exc)}
    return ERROR_CONTENT_TYPE, json.dumps(doc, separators=(",", ":")).encode()


def decode_error(key: str, content_type: str, data: bytes) -> BaseException:
    """Rebuild a recorded error (see the module docstring for what is trusted)."""
    if content_type != ERROR_CONTENT_TYPE:
        raise CorruptRecord(f"the error recorded for {key!r} has content type {content_type!r}", key=key)
    try:
        doc = json.loads(data)
        module_name, type_name, message = doc["module"], doc["type"], doc["message"]
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptRecord(f"the error recorded for {key!r} cannot be decoded: {exc}", key=key) from exc
    found: Any = sys.modules.get(str(module_name))
    for part in str(type_name).split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            return found(message)
        except Exception:  # a type whose constructor needs more than a message
            pass
    return TerminalError(f"{module_name}.{type_name}: {message}")


class KombuCodec:
    """Results through kombu's serializer registry (the same one Celery's backends use).

    Args:
        serializer: Serializer name (``json``, ``msgpack``, ``pickle``, ...).
        accept: Content types (or serializer names) that may be decoded; None accepts all.
        prepare: Applied to a result before it is serialized: the result backend's
            ``prepare_value``, so a result is stored as Celery stores it (an ``AsyncResult`` as
            its ``as_tuple()`` unless pickled) and a duplicate gets what ``get()`` returns.
    """

    def __init__(self, serializer: str = "json", accept: Collection[str] | None = None,
                 prepare: Callable[[Any], Any] | None = None) -> None:
        from kombu import exceptions, serialization

        self.serializer = serializer
        self.prepare = prepare
        self._serialization = serialization
        self._refused = exceptions.ContentDisallowed
        self._unreadable = exceptions.DecodeError
        # Celery settings name serializers ("json"); kombu's loads() compares content types.
        self.accept: set[str] | None = None
        if accept is not None:
            self.accept = serialization.prepare_accept_content(accept)  # type: ignore[no-untyped-call]

    def encode_result(self, value: Any) -> tuple[str, bytes]:
        if self.prepare is not None:
            value = self.prepare(value)
        content_type, encoding, data = self._serialization.dumps(  # type: ignore[no-untyped-call]
            value, serializer=self.serializer)
        if isinstance(data, str):
            data = data.encode(encoding)
        return f"{content_type};{encoding}", data

    def decode_result(self, key: str, content_type: str, data: bytes) -> Any:
        mime, _, encoding = content_type.partition(";")
        try:
            return self._serialization.loads(  # type: ignore[no-untyped-call]
                data, mime, encoding or "binary", accept=self.accept)
        except self._refused as exc:
            raise CorruptRecord(
                f"the result recorded for {key!r} is {mime}, which this app does not accept "
                f"(result_accept_content); it was not decoded",
                key=key) from exc
        except (self._unreadable, ValueError, TypeError) as exc:
            raise CorruptRecord(f"the result recorded for {key!r} cannot be decoded: {exc}", key=key) from exc

    encode_error = staticmethod(encode_error)
    decode_error = staticmethod(decode_error)
