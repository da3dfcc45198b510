"""A model's arguments checked against the tool's JSON Schema, with problems the model can act on.

The check is ``jsonschema``'s (Draft 2020-12 unless the schema names another), against the very
document the model was shown, so a hand-written ``parameters=`` is checked as fully as a derived
one. Two type rules are this library's: ``integer`` is an ``int`` or an integral float (``4200.0``:
JSON has one number type), never a ``bool``, and ``object`` is any mapping. :func:`integral`
then makes such a float the ``int`` the body expects.
``format`` is not checked (a ``datetime`` argument is text the body parses). Each error is put
in one sentence that names the argument (``argument 'items[1]' must be integer, got "2"``).
jsonschema is imported on the first check, not with this module (the ``[tools]`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator

__all__ = ["check_bounds", "check_schema", "integral", "validate"]


def validate(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Check ``value`` against ``schema``; return the problems, each naming the argument.

    Args:
        schema: A JSON Schema (a tool's ``parameters``, or one of its properties).
        value: The value to check.
        path: The argument ``value`` is (for the messages); empty for the whole arguments.

    Returns:
        One sentence per problem, the outer ones first; empty when ``value`` is valid.
    """
    errors = list(_validator_class(schema)(schema).iter_errors(value))
    # A value of the wrong type gets that one problem, not also each keyword it then fails.
    mistyped = {tuple(e.absolute_path) for e in errors if e.validator == "type"}
    kept = [e for e in errors if e.validator == "type" or tuple(e.absolute_path) not in mistyped]
    kept.sort(key=lambda e: len(e.absolute_path))  # stable: the schema's own order otherwise
    return list(dict.fromkeys(_sentence(e, path) for e in kept))  # one per missing name, etc.


def integral(schema: Mapping[str, Any], value: Any) -> Any:
    """``value`` (valid for ``schema``) with each float that stands for an ``integer`` made an
    ``int``: ``4200.0`` is ``4200`` to the body, as to the key."""
    if isinstance(value, float):
        kinds = [schema.get("type")] + [s.get("type") for s in schema.get("anyOf", ())]
        named = {k for t in kinds for k in (t if isinstance(t, list) else [t])}
        whole = value.is_integer() and "integer" in named and "number" not in named
        return int(value) if whole else value
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [integral(schema["items"], item) for item in value]
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {n: integral(props.get(n, extra if isinstance(extra, Mapping) else {}), v)
                for n, v in value.items()}
    return value


def check_bounds(value: Any, max_depth: int, max_size: int) -> str | None:
    """Say why ``value`` is too deep, too large or not encodable; None when it is within bounds.

    Walks ``value`` without recursion (a 100,000-deep list is refused, not a ``RecursionError``)
    and stops at the first problem, so a hostile input costs at most ``max_size`` steps. Lists,
    tuples and mappings nest (the arguments object is depth 1); a string counts its length
    towards ``max_size``, any other value a few characters. A string that UTF-8 cannot encode
    (a lone surrogate, which JSON's ``\\ud800`` escapes can make) is refused too: no key or
    message could carry it.

    Args:
        value: The parsed arguments.
        max_depth: The deepest nesting allowed.
        max_size: The largest size allowed, in characters of (about) its JSON text.
    """
    size = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            size += len(item) + 2
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return "a text value holds an unpaired surrogate (not valid Unicode)"
        elif isinstance(item, (Mapping, list, tuple)):
            if depth > max_depth:
                return f"they are nested deeper than {max_depth} levels"
            # Counted before its items are stacked: a huge container stops here, in one step.
            size += 2 + len(item)
            if size > max_size:
                return f"they are larger than {max_size} characters"
            if isinstance(item, Mapping):
                for name, sub in item.items():
                    stack.append((name, depth))
                    stack.append((sub, depth + 1))
            else:
                stack.extend((sub, depth + 1) for sub in item)
        else:
            size += 8
        if size > max_size:
            return f"they are larger than {max_size} characters"
    return None


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.SchemaError`` when ``schema`` is not a valid JSON Schema."""
    _validator_class(schema).check_schema(schema)


def _validator_class(schema: Mapping[str, Any]) -> type[Validator]:
    try:
        from jsonschema.validators import validator_for
    except ImportError as exc:
        raise ImportError("celery_idem tools check arguments with jsonschema: "
                          "pip install 'celery-idem[tools]'") from exc

    return _with_our_types(validator_for(schema, default=_default()))


def _default() -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator


@lru_cache(maxsize=8)
def _with_our_types(base: type[Validator]) -> type[Validator]:
    """``base`` with this library's ``integer`` and ``object`` (see the module docstring)."""
    from jsonschema.validators import extend

    checker = base.TYPE_CHECKER.redefine_many({
        "integer": lambda _, v: (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer()),
        "object": lambda _, v: isinstance(v, Mapping),
    })
    extended: type[Validator] = extend(base, type_checker=checker)
    return extended


def _name(error: ValidationError, path: str) -> str:
    """The failing value's argument name: ``items[1]``, ``address.street``; empty for the whole."""
    name = path
    for part in error.absolute_path:
        name = f"{name}[{part}]" if isinstance(part, int) else f"{name}.{part}" if name else str(part)
    return name


def _where(name: str) -> str:
    return f"argument {name!r}" if name else "the arguments"


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _names(what: str, names: list[str]) -> str:
    return f"{what}{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)}"


def _type(e: ValidationError, name: str) -> str:
    kinds = [e.validator_value] if isinstance(e.validator_value, str) else list(e.validator_value)
    number = isinstance(e.instance, str) and not {"integer", "number"}.isdisjoint(kinds)
    text = " (a JSON number, not text)" if number else ""
    return f"{_where(name)} must be {' or '.join(kinds)}{text}, got {_show(e.instance)}"


def _required(e: ValidationError, name: str) -> str:
    # jsonschema reports each missing name on its own; one sentence names them all.
    missing = [f"{name}.{n}" if name else n for n in e.validator_value if n not in e.instance]
    return "missing required " + _names("argument", missing)


def _unknown(e: ValidationError, name: str) -> str:
    known = list(e.schema.get("properties", {}))
    unknown = [n for n in e.instance if n not in known]
    return _names("unknown argument", unknown) + f" (expected: {', '.join(known) or 'none'})"


#: One sentence per keyword the derived schemas use; any other keyword gets jsonschema's text.
_SENTENCES: dict[str, Callable[[ValidationError, str], str]] = {
    "type": _type,
    "enum": lambda e, name: f"{_where(name)} must be one of {json.dumps(e.validator_value)}, "
                            f"got {_show(e.instance)}",
    "required": _required,
    "additionalProperties": _unknown,
    **dict.fromkeys(("anyOf", "oneOf"), lambda e, name: f"{_where(name)}: {_show(e.instance)} "
                                                        f"matches none of the allowed types"),
    "minItems": lambda e, name: f"{_where(name)} needs at least {e.validator_value} items",
    "maxItems": lambda e, name: f"{_where(name)} takes at most {e.validator_value} items",
}


def _sentence(error: ValidationError, path: str) -> str:
    name = _name(error, path)
    say = _SENTENCES.get(str(error.validator))
    return say(error, name) if say else f"{_where(name)}: {error.message}"
