"""The tool's description in both vendors' formats, derived from the task's signature and docstring.

No worker: building a tool and its schema talks to no server.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional, Union

import pytest
from celery import Celery

from celery_idem import IdempotentTask
from celery_idem.contrib.tools import WRITE_NOTE, Tool, Toolbox, ToolError, tool, validate
from tests.tools.app import charge_card, create_shipment, stock_level

CHARGE_PARAMETERS = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "description": "The shop's order id."},
        "amount_cents": {"type": "integer", "description": "The amount, in cents."},
        "currency": {"type": "string", "enum": ["usd", "eur"], "description": "ISO currency code.",
                     "default": "usd"},
        "hold": {"type": "boolean",
                 "description": "Test hook: keep running until the test releases the order.",
                 "default": False},
    },
    "required": ["order_id", "amount_cents"],
    "additionalProperties": False,
}
CHARGE_DESCRIPTION = "Charge the customer's card for an order.\n\n" + WRITE_NOTE


def test_openai_chat_format_of_a_bound_task_leaves_self_out() -> None:
    assert tool(charge_card).openai() == {
        "type": "function",
        "function": {"name": "charge_card", "description": CHARGE_DESCRIPTION,
                     "parameters": CHARGE_PARAMETERS},
    }


def test_openai_responses_format_is_flat() -> None:
    assert tool(charge_card).openai(api="responses") == {
        "type": "function", "name": "charge_card", "description": CHARGE_DESCRIPTION,
        "parameters": CHARGE_PARAMETERS, "strict": False,
    }


def test_anthropic_format() -> None:
    assert tool(charge_card).anthropic() == {
        "name": "charge_card", "description": CHARGE_DESCRIPTION,
        "input_schema": CHARGE_PARAMETERS,
    }


def test_both_formats_are_plain_json() -> None:
    t = tool(charge_card)
    for spec in (t.openai(), t.openai("responses"), t.anthropic()):
        assert json.loads(json.dumps(spec)) == spec


def test_a_read_tool_gets_no_write_note_and_a_name_override() -> None:
    t = tool(stock_level, kind="read", name="stock-level", description="Stock of a product.")
    assert t.anthropic() == {
        "name": "stock-level", "description": "Stock of a product.",
        "input_schema": {"type": "object", "properties": {"sku": {"type": "string"}},
                         "required": ["sku"], "additionalProperties": False},
    }


class Speed(enum.Enum):
    STANDARD = "standard"
    EXPRESS = "express"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


def every_type(
    a: str, b: int, c: float, d: bool, e: list[int], f: dict[str, float],
    g: Optional[str],  # noqa: UP045 (typing.Union, not the X | None of h)
    h: int | None, i: Literal["x", "y"], j: Speed, k: Priority,
    m: tuple[int, ...], n: tuple[str, int], o: set[str], p: dt.datetime, q: dt.date,
    r: Annotated[str, "what r is"], s: Any, t: list[dict[str, Any]], u=None, w: str = "w",
    x: Speed = Speed.EXPRESS, y: list[str] | None = None,
) -> None:
    """Every supported annotation."""


def test_every_supported_annotation_has_its_json_schema() -> None:
    props = tool(every_type, kind="read").parameters["properties"]
    assert props == {
        "a": {"type": "string"},
        "b": {"type": "integer"},
        "c": {"type": "number"},
        "d": {"type": "boolean"},
        "e": {"type": "array", "items": {"type": "integer"}},
        "f": {"type": "object", "additionalProperties": {"type": "number"}},
        "g": {"type": ["string", "null"]},
        "h": {"type": ["integer", "null"]},
        "i": {"type": "string", "enum": ["x", "y"]},
        "j": {"type": "string", "enum": ["standard", "express"]},
        "k": {"type": "integer", "enum": [1, 2]},
        "m": {"type": "array", "items": {"type": "integer"}},
        "n": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
              "minItems": 2, "maxItems": 2},
        "o": {"type": "array", "items": {"type": "string"}},
        "p": {"type": "string", "format": "date-time"},
        "q": {"type": "string", "format": "date"},
        "r": {"type": "string", "description": "what r is"},
        "s": {},
        "t": {"type": "array", "items": {"type": "object", "additionalProperties": {}}},
        "u": {"default": None},
        "w": {"type": "string", "default": "w"},
        "x": {"type": "string", "enum": ["standard", "express"], "default": "express"},
        "y": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
              "default": None},
    }
    assert tool(every_type, kind="read").parameters["required"] == list("abcdefghijkmnopqrst")


def test_docstring_args_become_parameter_descriptions_and_sections_are_cut() -> None:
    def book(room: str, nights: int = 1) -> None:
        """Book a room.

        Only rooms that are free.

        Args:
            room: The room number,
                as printed on the door.
            nights (int): How many nights.

        Returns:
            Nothing.
        """

    t = tool(book, kind="read")
    assert t.description == "Book a room.\n\nOnly rooms that are free."
    assert t.parameters["properties"] == {
        "room": {"type": "string", "description": "The room number, as printed on the door."},
        "nights": {"type": "integer", "description": "How many nights.", "default": 1},
    }


def test_a_write_tool_must_be_an_idempotent_task() -> None:
    with pytest.raises(ToolError, match="must be an IdempotentTask"):
        tool(stock_level)  # a plain Celery task
    with pytest.raises(ToolError, match="must be an IdempotentTask"):
        tool(every_type)  # a function
    with pytest.raises(ToolError, match="cannot be a read tool"):
        tool(charge_card, kind="read")


class Money:
    """A type with no JSON Schema."""


def test_bad_tool_definitions_are_refused_with_the_reason() -> None:
    class Local:
        pass

    def local(amount: Local) -> None: ...
    def pay(amount: Money) -> None: ...
    def spread(*items: str) -> None: ...
    def keyed(m: dict[int, str]) -> None: ...

    with pytest.raises(ToolError, match=r"parameter 'amount'.*Money.*pass parameters="):
        tool(pay, kind="read")
    with pytest.raises(ToolError, match=r"parameter 'amount'.*'Local' cannot be resolved"):
        tool(local, kind="read")
    with pytest.raises(ToolError, match="parameter 'items' is variadic positional"):
        tool(spread, kind="read")
    with pytest.raises(ToolError, match="str keys"):
        tool(keyed, kind="read")
    with pytest.raises(ValueError, match="not accepted by OpenAI or Anthropic"):
        tool(pay, kind="read", name="pay money")
    with pytest.raises(ValueError, match="kind must be"):
        tool(pay, kind="delete")  # type: ignore[arg-type]
    with pytest.raises(ToolError, match="ignore_result"):
        app = Celery("ignored", broker="memory://", set_as_current=False)

        def quiet(a: int) -> int:
            return a

        tool(app.task(base=IdempotentTask, ignore_result=True, name="t.x")(quiet))
    with pytest.raises(ValueError, match="two tools are named 'charge_card'"):
        Toolbox([tool(charge_card), tool(charge_card)])


def test_a_hand_written_schema_replaces_the_derived_one() -> None:
    schema = {"type": "object", "properties": {"amount": {"type": "string"}}, "required": ["amount"]}

    def pay(amount: Money) -> None: ...

    assert tool(pay, kind="read", parameters=schema).parameters == schema
    with pytest.raises(ToolError, match='"type": "object"'):
        tool(pay, kind="read", parameters={"type": "string"})


@pytest.mark.parametrize(("arguments", "problem"), [
    ({"order_id": "o"}, "missing required argument 'amount_cents'"),
    ({"order_id": "o", "amount_cents": 1, "amount": 2}, "unknown argument 'amount' (expected: "
                                                        "order_id, amount_cents, currency, hold)"),
    ({"order_id": "o", "amount_cents": "12"},
     "argument 'amount_cents' must be integer (a JSON number, not text), got \"12\""),
    ({"order_id": "o", "amount_cents": True}, "argument 'amount_cents' must be integer, got true"),
    ({"order_id": "o", "amount_cents": 1, "currency": "gbp"},
     "argument 'currency' must be one of [\"usd\", \"eur\"], got \"gbp\""),
])
def test_validation_names_the_argument(arguments: dict[str, Any], problem: str) -> None:
    assert problem in validate(tool(charge_card).parameters, arguments)


def test_nested_values_are_validated() -> None:
    schema = tool(every_type, kind="read").parameters["properties"]
    text = "(a JSON number, not text)"
    assert validate(schema["e"], [1, "2"], "e") == [f"argument 'e[1]' must be integer {text}, got \"2\""]
    assert validate(schema["f"], {"k": "v"}, "f") == [f"argument 'f.k' must be number {text}, got \"v\""]
    assert validate(schema["n"], [1.5], "n") == ["argument 'n' needs at least 2 items",
                                               "argument 'n[0]': 1.5 matches none of the allowed types"]
    assert validate(schema["y"], None, "y") == []


def test_the_toolbox_lists_every_tool_in_each_format() -> None:
    box = Toolbox([tool(stock_level, kind="read"), tool(charge_card), tool(create_shipment)])
    assert [t["function"]["name"] for t in box.openai()] == ["stock_level", "charge_card",
                                                             "create_shipment"]
    assert [t["name"] for t in box.anthropic()] == ["stock_level", "charge_card", "create_shipment"]
    assert "charge_card" in box and len(box) == 3 and isinstance(box["charge_card"], Tool)


def test_an_unknown_tool_name_is_an_error_result_not_an_exception() -> None:
    box = Toolbox([tool(stock_level, kind="read")])
    out = box.call("delete_everything", "{}")
    assert out["status"] == "error" and out["error"] == "UnknownTool" and out["retryable"] is False
    assert "stock_level" in out["message"]


def test_openai_strict_mode_requires_every_property_and_drops_defaults() -> None:
    spec = tool(charge_card).openai(strict=True)
    assert spec["function"]["strict"] is True
    assert spec["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "description": "The shop's order id."},
            "amount_cents": {"type": "integer", "description": "The amount, in cents."},
            "currency": {"anyOf": [{"type": "string", "enum": ["usd", "eur"]}, {"type": "null"}],
                         "description": 'ISO currency code; null means the default, "usd".'},
            "hold": {"type": ["boolean", "null"],
                     "description": "Test hook: keep running until the test releases the order; "
                                    "null means the default, false."},
        },
        "required": ["order_id", "amount_cents", "currency", "hold"],
        "additionalProperties": False,
    }
    assert tool(charge_card).openai("responses", strict=True)["strict"] is True
    assert "strict" not in tool(charge_card).openai()["function"]  # off unless asked


def test_strict_mode_refuses_what_it_cannot_describe() -> None:
    def free(meta: dict[str, int]) -> None: ...
    def untyped(value) -> None: ...  # type: ignore[no-untyped-def]

    with pytest.raises(ToolError, match=r"free\.meta: strict mode cannot describe a free-form"):
        tool(free, kind="read").openai(strict=True)
    with pytest.raises(ToolError, match=r"untyped\.value: strict mode needs a type"):
        tool(untyped, kind="read").openai(strict=True)


def test_a_null_for_an_argument_with_a_default_means_the_default() -> None:
    seen: list[dict[str, Any]] = []

    def book(room: str, nights: int = 1, note: str | None = "x") -> None:
        seen.append({"room": room, "nights": nights, "note": note})

    t = tool(book, kind="read")
    assert t.invoke({"room": "12", "nights": None, "note": None})["status"] == "ok"
    assert seen == [{"room": "12", "nights": 1, "note": None}]  # note may be null: kept
    out = t.invoke({"room": None})
    assert out["status"] == "error" and "'room' must be string, got null" in out["message"]


def test_abstract_collection_hints_and_unions() -> None:
    def f(a: Sequence[str], b: Mapping[str, bool], c: Union[int, str]) -> None: ...  # noqa: UP007

    assert tool(f, kind="read").parameters["properties"] == {
        "a": {"type": "array", "items": {"type": "string"}},
        "b": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "c": {"type": ["integer", "string"]},
    }


def test_importing_the_module_imports_no_optional_package() -> None:
    import subprocess
    import sys

    code = ("import sys, celery_idem.contrib.tools; "
            "print(sorted(m for m in ('langchain_core', 'pydantic', 'redis', 'sqlalchemy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_langchain_missing_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "langchain_core.tools", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install langchain-core"):
        tool(charge_card).langchain()


def test_a_key_argument_must_be_a_string_parameter_of_a_write_tool() -> None:
    with pytest.raises(ValueError, match="must be a string parameter"):
        tool(charge_card, key_argument="amount_cents")
    with pytest.raises(ValueError, match="for write tools"):
        tool(stock_level, kind="read", key_argument="sku")


def test_mcp_annotations_follow_the_tool_definition() -> None:
    write = tool(charge_card, destructive=False, open_world=False, title="Charge")
    assert write.annotations() == {"title": "Charge", "readOnlyHint": False,
                                   "destructiveHint": False, "idempotentHint": True,
                                   "openWorldHint": False}
    assert tool(charge_card).annotations()["destructiveHint"] is True
    assert tool(stock_level, kind="read").annotations() == {"readOnlyHint": True,
                                                             "openWorldHint": True}
    spec = write.mcp()
    assert spec["inputSchema"] == write.parameters and spec["annotations"] == write.annotations()
    spec["outputSchema"]["properties"].clear()  # a caller's change does not leak into the next
    assert write.mcp()["outputSchema"]["properties"]
