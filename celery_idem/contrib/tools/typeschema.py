"""The JSON Schema of one type hint, from pydantic, in the subset OpenAI and Anthropic accept.

pydantic's ``TypeAdapter`` is the generator the vendors' SDKs and the agent frameworks use, so a
hint they accept is accepted here: models, dataclasses, ``TypedDict``, ``Annotated[int,
Field(ge=1)]``... :class:`VendorSchema` narrows its output to what both vendors take: no
``$ref`` (definitions are inlined), no ``title``, ``type: [X, "null"]`` for a union of simple
types, one ``items`` schema for a fixed-length tuple (no ``prefixItems``), no ``uniqueItems``, a
``Decimal`` as text, and no ``bytes`` (JSON has none). This module imports pydantic;
:mod:`~celery_idem.contrib.tools.schema` imports it when the first tool is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema as cs

from .outcome import ToolError

__all__ = ["VendorSchema", "inline", "type_schema"]


def type_schema(hint: Any) -> dict[str, Any]:
    """JSON Schema of ``hint`` (definitions inlined, no titles).

    Raises:
        ToolError: The type has no JSON Schema (pydantic's reason is in the message).
    """
    try:
        raw = TypeAdapter(hint).json_schema(schema_generator=VendorSchema)
    except ToolError:
        raise
    except Exception as exc:  # pydantic's schema-generation errors, or a hint it cannot take
        # pydantic's first sentence says what it could not do; the rest is advice for models.
        reason = (str(exc).strip() or type(exc).__name__).splitlines()[0].split(". ")[0]
        raise ToolError(
            f"type {getattr(hint, '__qualname__', hint)!r} has no JSON Schema ({reason}); "
            f"pass parameters="
        ) from None
    return inline(raw, raw.get("$defs", {}))


class VendorSchema(GenerateJsonSchema):
    """pydantic's JSON Schema generator, narrowed to what OpenAI and Anthropic accept."""

    def union_schema(self, schema: cs.UnionSchema) -> JsonSchemaValue:
        return _union(super().union_schema(schema))

    def nullable_schema(self, schema: cs.NullableSchema) -> JsonSchemaValue:
        return _union(super().nullable_schema(schema))

    def tuple_schema(self, schema: cs.TupleSchema) -> JsonSchemaValue:
        # Fixed positions as one item schema and a length: prefixItems is 2020-12 only.
        out = super().tuple_schema(schema)
        items = out.pop("prefixItems", None)
        if items is not None:
            unique = [i for n, i in enumerate(items) if i not in items[:n]]
            out["items"] = unique[0] if len(unique) == 1 else {"anyOf": unique}
        return _no_empty_items(out)

    def list_schema(self, schema: cs.ListSchema) -> JsonSchemaValue:
        return _no_empty_items(super().list_schema(schema))

    def set_schema(self, schema: cs.SetSchema) -> JsonSchemaValue:
        # A set takes duplicates and drops them; OpenAI's strict mode has no uniqueItems.
        return _any_items(super().set_schema(schema))

    def frozenset_schema(self, schema: cs.FrozenSetSchema) -> JsonSchemaValue:
        return _any_items(super().frozenset_schema(schema))

    def dict_schema(self, schema: cs.DictSchema) -> JsonSchemaValue:
        keys, values = schema.get("keys_schema"), schema.get("values_schema")
        if keys is not None and self.generate_inner(keys).get("type", "string") != "string":
            raise ToolError("JSON objects have str keys only")
        if _is_any(values) and _is_any(keys):
            return {"type": "object"}  # a bare dict: any object
        out = super().dict_schema(schema)
        if out.get("additionalProperties") is True:
            out["additionalProperties"] = {}  # any value, said as a schema
        return out

    def decimal_schema(self, schema: cs.DecimalSchema) -> JsonSchemaValue:
        # Text, so no digit is lost to a float; the body gets the string and parses it.
        return {"type": "string", "description": "a decimal number, as text"}

    def bytes_schema(self, schema: cs.BytesSchema) -> JsonSchemaValue:
        # JSON has no bytes: the body would get a str where it expects bytes.
        raise ToolError("bytes have no JSON form (take a str, e.g. base64 text)")


def _union(schema: JsonSchemaValue) -> JsonSchemaValue:
    """A union as both vendors take it best: a type list when every member is one simple type,
    ``{}`` when one member is any value."""
    members = schema.get("anyOf")
    if set(schema) != {"anyOf"} or not isinstance(members, list):
        return schema
    if any(m == {} for m in members):
        return {}
    if all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
        return {"type": [m["type"] for m in members]}
    return schema


def _is_any(schema: cs.CoreSchema | None) -> bool:
    return schema is None or schema["type"] == "any"


def _no_empty_items(schema: JsonSchemaValue) -> JsonSchemaValue:
    """``{"type": "array"}`` (no ``items``) for an array of anything."""
    if schema.get("items") == {}:
        del schema["items"]
    return schema


def _any_items(schema: JsonSchemaValue) -> JsonSchemaValue:
    schema.pop("uniqueItems", None)
    return _no_empty_items(schema)


# ---------------------------------------------------------------------------------------------
# inlining: one self-contained schema per parameter
# ---------------------------------------------------------------------------------------------

_Walk = Callable[[Any], Any]
#: How each keyword's value holds subschemas; any other keyword's value is kept as it is.
_SUBSCHEMAS: dict[str, Callable[[Any, _Walk], Any]] = {
    "properties": lambda value, walk: {n: walk(s) for n, s in value.items()},
    **dict.fromkeys(("anyOf", "oneOf", "allOf", "prefixItems"),
                    lambda value, walk: [walk(s) for s in value]),
    **dict.fromkeys(("items", "additionalProperties", "not", "contains", "propertyNames"),
                    lambda value, walk: walk(value) if isinstance(value, Mapping) else value),
}


def inline(schema: Mapping[str, Any], defs: Mapping[str, Any],
           seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """``schema`` with every ``$ref`` replaced by its definition and every ``title`` left out.

    Raises:
        ToolError: A type refers to itself (a recursive model cannot be inlined).
    """
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        if name in seen or name not in defs:
            raise ToolError(f"{name!r} refers to itself, which cannot be inlined; pass parameters=")
        merged = {**defs[name], **{k: v for k, v in schema.items() if k != "$ref"}}
        return inline(merged, defs, (*seen, name))

    def walk(sub: Any) -> Any:
        return inline(sub, defs, seen)

    keep = (k for k in schema if k not in ("title", "$defs"))
    return {k: _SUBSCHEMAS[k](schema[k], walk) if k in _SUBSCHEMAS else schema[k] for k in keep}
