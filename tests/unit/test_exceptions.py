"""The exception tree, and exceptions surviving str(), pickle and the store's error codec."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import celery.exceptions
import pytest

import celery_idem
from celery_idem import exceptions
from celery_idem.codec import ERROR_CONTENT_TYPE, KombuCodec, decode_error, encode_error
from celery_idem.exceptions import (
    CorruptRecord,
    IdempotencyError,
    IdempotencyKeyMismatch,
    ImproperlyConfigured,
    LeaseLost,
    StoreUnavailable,
    TerminalError,
)

ALL = [TerminalError, IdempotencyKeyMismatch, LeaseLost, StoreUnavailable, CorruptRecord,
       ImproperlyConfigured]


class OutOfStock(TerminalError):
    """A project's terminal error, defined in an imported module."""


class NeedsTwoArguments(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code}: {reason}")


@pytest.mark.parametrize("cls", ALL)
def test_every_exception_derives_from_idempotency_error(cls: type[Exception]) -> None:
    assert issubclass(cls, IdempotencyError)
    assert issubclass(cls, Exception)


def test_the_tree_has_the_documented_shape() -> None:
    assert IdempotencyKeyMismatch.__bases__ == (TerminalError,)
    for cls in (TerminalError, LeaseLost, StoreUnavailable, CorruptRecord):
        assert cls.__bases__ == (IdempotencyError,)
    assert IdempotencyError.__bases__ == (Exception,)


def test_improperly_configured_is_also_celerys() -> None:
    with pytest.raises(celery.exceptions.ImproperlyConfigured):
        raise ImproperlyConfigured("bad")
    with pytest.raises(ImproperlyConfigured):
        raise ImproperlyConfigured("bad")
    assert type(ImproperlyConfigured("a")) is type(ImproperlyConfigured("b"))


def test_no_class_is_rebuilt_at_runtime() -> None:
    # The public class keeps the bases it was defined with; Celery's comes in by a subclass.
    assert ImproperlyConfigured.__bases__ == (IdempotencyError,)
    exc = ImproperlyConfigured("bad")
    assert type(exc).__name__ == "ImproperlyConfigured" and type(exc).__module__ == exceptions.__name__


def test_every_exception_in_the_module_is_in_its_all_and_exported_by_the_package() -> None:
    defined = {
        name for name, value in vars(exceptions).items()
        if isinstance(value, type) and issubclass(value, BaseException)
        and value.__module__ == exceptions.__name__
    }
    assert defined == set(exceptions.__all__)
    assert defined <= set(celery_idem.__all__)


def test_every_exception_class_has_a_raised_when_docstring() -> None:
    for cls in [IdempotencyError, *ALL]:
        assert cls.__doc__ and cls.__doc__.startswith("Raised "), cls


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(IdempotencyError("root"), id="IdempotencyError"),
        pytest.param(TerminalError("card declined"), id="TerminalError"),
        pytest.param(StoreUnavailable("redis down"), id="StoreUnavailable"),
        pytest.param(ImproperlyConfigured("no store"), id="ImproperlyConfigured"),
        pytest.param(IdempotencyKeyMismatch("other args", key="k1"), id="IdempotencyKeyMismatch"),
        pytest.param(LeaseLost("taken over", key="k1", token=7), id="LeaseLost"),
        pytest.param(CorruptRecord("garbage", key="k1"), id="CorruptRecord"),
    ],
)
def test_str_is_the_message_and_pickle_keeps_type_message_and_attributes(
    exc: Exception,
) -> None:
    message = exc.args[0]
    assert str(exc) == message
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc)
    assert str(copy) == message
    for attribute in ("key", "token"):
        assert getattr(copy, attribute, None) == getattr(exc, attribute, None)


def test_lease_lost_keeps_key_and_token_through_pickle() -> None:
    copy = pickle.loads(pickle.dumps(LeaseLost("refused", key="op:abc", token=12)))
    assert (copy.key, copy.token, str(copy)) == ("op:abc", 12, "refused")


def test_attributes_default_to_none() -> None:
    assert LeaseLost("x").key is None and LeaseLost("x").token is None
    assert IdempotencyKeyMismatch("x").key is None
    assert CorruptRecord("x").key is None


@pytest.mark.parametrize(
    "exc",
    [
        pytest.param(OutOfStock("sku-1 is out of stock"), id="a project TerminalError"),
        pytest.param(TerminalError("déclinée"), id="TerminalError, non-ASCII"),
        pytest.param(IdempotencyKeyMismatch("other args"), id="IdempotencyKeyMismatch"),
        pytest.param(ValueError("bad amount"), id="builtin ValueError"),
        pytest.param(celery.exceptions.Ignore("ignored"), id="a celery type"),
    ],
)
def test_an_encoded_error_decodes_to_the_same_type_and_message(exc: Exception) -> None:
    content_type, data = encode_error(exc)
    assert content_type == ERROR_CONTENT_TYPE
    back = decode_error("k", content_type, data)
    assert type(back) is type(exc)
    assert str(back) == str(exc)


def test_the_codec_methods_are_the_module_functions() -> None:
    codec = KombuCodec("json", ["json"])
    content_type, data = codec.encode_error(OutOfStock("none left"))
    assert (content_type, data) == encode_error(OutOfStock("none left"))
    back = codec.decode_error("k", content_type, data)
    assert (type(back), str(back)) == (OutOfStock, "none left")


def test_the_encoded_error_names_module_type_and_message() -> None:
    _, data = encode_error(OutOfStock("none left"))
    assert json.loads(data) == {
        "module": __name__, "type": "OutOfStock", "message": "none left",
    }


def test_an_error_of_a_module_that_is_not_imported_becomes_a_terminal_error_naming_it() -> None:
    data = json.dumps(
        {"module": "payments_never_imported", "type": "Declined", "message": "no funds"}
    ).encode()
    back = decode_error("k", ERROR_CONTENT_TYPE, data)
    assert type(back) is TerminalError
    assert "payments_never_imported.Declined" in str(back)
    assert "no funds" in str(back)
    assert "payments_never_imported" not in sys.modules


def test_an_error_type_whose_constructor_needs_more_than_a_message_becomes_terminal() -> None:
    content_type, data = encode_error(NeedsTwoArguments(402, "declined"))
    back = decode_error("k", content_type, data)
    assert type(back) is TerminalError
    assert "NeedsTwoArguments" in str(back) and "402: declined" in str(back)


@pytest.mark.parametrize(
    ("module", "type_name"),
    [
        pytest.param("builtins", "print", id="a function, not a type"),
        pytest.param("builtins", "int", id="a type that is not an exception"),
        pytest.param("os", "system", id="a dangerous callable"),
        pytest.param("builtins", "KeyboardInterrupt", id="a BaseException, not an Exception"),
    ],
)
def test_a_recorded_name_that_is_not_an_exception_type_is_never_called(
    module: str, type_name: str
) -> None:
    data = json.dumps({"module": module, "type": type_name, "message": "echo pwned"}).encode()
    back = decode_error("k", ERROR_CONTENT_TYPE, data)
    assert type(back) is TerminalError
    assert f"{module}.{type_name}" in str(back)


def test_decoding_an_error_never_imports_a_module() -> None:
    # In a fresh interpreter, a record naming an importable but unimported module
    code = (
        "import json, sys\n"
        "from celery_idem.codec import ERROR_CONTENT_TYPE, decode_error\n"
        "assert 'wave' not in sys.modules\n"
        "doc = {'module': 'wave', 'type': 'Error', 'message': 'm'}\n"
        "back = decode_error('k', ERROR_CONTENT_TYPE, json.dumps(doc).encode())\n"
        "print(type(back).__name__, 'wave' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["TerminalError", "False"]


@pytest.mark.parametrize(
    ("content_type", "data"),
    [
        pytest.param("application/json", b'{"module":"builtins","type":"ValueError","message":""}',
                     id="wrong content type"),
        pytest.param(ERROR_CONTENT_TYPE, b"not json", id="not json"),
        pytest.param(ERROR_CONTENT_TYPE, b'{"module":"builtins"}', id="fields missing"),
    ],
)
def test_an_unreadable_error_record_raises_corrupt_record_naming_the_key(
    content_type: str, data: bytes
) -> None:
    with pytest.raises(CorruptRecord) as info:
        decode_error("op:k1", content_type, data)
    assert info.value.key == "op:k1"
    assert "op:k1" in str(info.value)
