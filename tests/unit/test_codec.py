"""KombuCodec writes what kombu's registry writes, reads it back, and fails as it fails."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import pytest
from kombu import serialization
from kombu.exceptions import EncodeError

from celery_idem.codec import KombuCodec

VALUES: list[Any] = [
    None, True, 0, -7, 2**70, 1.5, float("inf"), float("nan"), "", "é ☃ \U0001f600 \x00",
    [1, "a", None], {"a": [1, {"b": 2.25}], "ü": "x"}, (1, 2),
    datetime.datetime(2026, 12, 4, 5, 6, 7, 891, tzinfo=datetime.timezone.utc),
    datetime.date(2026, 12, 4), datetime.time(5, 6, 7), uuid.UUID(int=42),
    decimal.Decimal("1.10"), b"bytes \xff", {"nested": [b"\x00", uuid.UUID(int=1)]},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_the_codec_writes_the_registrys_bytes(value: Any) -> None:
    codec = KombuCodec("json", ["json"])
    content_type, encoding, expected = serialization.dumps(value, serializer="json")
    assert codec.encode_result(value) == (f"{content_type};{encoding}", expected.encode(encoding))
    ctype, data = codec.encode_result(value)
    decoded = codec.decode_result("k", ctype, data)
    assert repr(decoded) == repr(serialization.loads(expected, content_type, encoding))


def test_an_unencodable_value_raises_kombus_encode_error() -> None:
    with pytest.raises(EncodeError):
        KombuCodec("json", ["json"]).encode_result(object())


def test_a_serializer_registered_as_json_later_is_used_as_it_is() -> None:
    codec = KombuCodec("json", ["json"])
    registry = serialization.registry
    encoder, decoder = registry._encoders["json"], registry._decoders["application/json"]
    serialization.register("json", lambda v: '"custom"', lambda s: s,
                           content_type="application/json", content_encoding="utf-8")
    try:
        assert codec.encode_result({"a": 1}) == ("application/json;utf-8", b'"custom"')
    finally:
        registry._encoders["json"], registry._decoders["application/json"] = encoder, decoder
    assert codec.encode_result({"a": 1}) == ("application/json;utf-8", b'{"a": 1}')
