"""The tools add-on as a package: its layout, and what pydantic and
jsonschema (the ``[tools]`` extra) bring to the schema and the checks.

No worker: building a tool and checking arguments talk to no server.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field
from typing_extensions import TypedDict  # pydantic needs it below Python 3.12

import celery_idem.contrib.tools as contrib_tools
from celery_idem.contrib.tools import ToolError, tool, validate
from celery_idem.contrib.tools.validation import integral
from tests.tools.app import charge_card

PACKAGE = Path(contrib_tools.__file__).parent
CONTRIB = PACKAGE.parent


def test_importing_the_package_imports_neither_pydantic_nor_jsonschema() -> None:
    code = ("import sys, celery_idem.contrib.tools; "
            "print(sorted(m for m in ('jsonschema', 'langchain_core', 'pydantic', 'redis', "
            "'sqlalchemy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    return [("." * node.level + (node.module or ""), [a.name for a in node.names])
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


def test_the_add_on_imports_no_private_name_and_no_module_is_over_600_lines() -> None:
    for path in sorted(CONTRIB.rglob("*.py")):
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.endswith("__")]
            assert not private, f"{path.relative_to(CONTRIB)} imports {private} from {module}"
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.relative_to(CONTRIB)} has {lines} lines"


class Address(BaseModel):
    """Where a parcel goes."""

    street: str
    zip_code: Annotated[str, Field(description="Postal code.", min_length=3)]
    floor: int | None = None


@dataclasses.dataclass
class Window:
    start: str
    hours: int = 2


class Line(TypedDict):
    sku: str
    quantity: int


class Node(BaseModel):
    children: list[Node]


def test_models_dataclasses_and_typed_dicts_are_described_inline() -> None:
    def ship(to: Address, window: Window, lines: list[Line],
             count: Annotated[int, Field(ge=1, le=10)] = 1) -> None: ...

    props = tool(ship, kind="read").parameters["properties"]
    assert props["to"] == {
        "type": "object", "description": "Where a parcel goes.",
        "properties": {"street": {"type": "string"},
                       "zip_code": {"type": "string", "description": "Postal code.", "minLength": 3},
                       "floor": {"type": ["integer", "null"], "default": None}},
        "required": ["street", "zip_code"],
    }
    assert props["window"]["properties"] == {"start": {"type": "string"},
                                             "hours": {"type": "integer", "default": 2}}
    assert props["lines"]["items"]["required"] == ["sku", "quantity"]
    assert props["count"] == {"type": "integer", "minimum": 1, "maximum": 10, "default": 1}
    assert "$defs" not in str(props) and "$ref" not in str(props) and "title" not in str(props)
    # The constraints pydantic wrote are checked before anything runs.
    schema = tool(ship, kind="read").parameters
    problems = validate(schema, {"to": {"street": "s", "zip_code": "1"}, "window": {"start": "9"},
                                 "lines": [{"sku": "a", "quantity": "2"}], "count": 11})
    assert problems == ["argument 'count': 11 is greater than the maximum of 10",
                        "argument 'to.zip_code': '1' is too short",
                        "argument 'lines[0].quantity' must be integer (a JSON number, not text), got \"2\""]


def test_what_json_cannot_carry_is_still_refused() -> None:
    def upload(data: bytes) -> None: ...
    def tree(root: Node) -> None: ...

    with pytest.raises(ToolError, match=r"parameter 'data': bytes have no JSON form"):
        tool(upload, kind="read")
    with pytest.raises(ToolError, match=r"parameter 'root'.*refers to itself.*pass parameters="):
        tool(tree, kind="read")


def test_an_integer_stays_an_int_and_a_hand_written_schema_is_checked_in_full() -> None:
    schema = tool(charge_card).parameters
    # JSON has one number type: 1.0 is the integer 1 (and the body gets an int); 1.5 and a bool
    # are not integers
    assert validate(schema, {"order_id": "o", "amount_cents": 1.0}) == []
    assert type(integral(schema, {"order_id": "o", "amount_cents": 1.0})["amount_cents"]) is int
    assert validate(schema, {"order_id": "o", "amount_cents": 1.5}) == [
        "argument 'amount_cents' must be integer, got 1.5"]
    assert validate(schema, {"order_id": "o", "amount_cents": True}) == [
        "argument 'amount_cents' must be integer, got true"]
    hand: dict[str, Any] = {"type": "object", "properties": {"code": {"type": "string",
                                                                      "pattern": "^[A-Z]{3}$"}}}

    def pay(code: str) -> None: ...

    t = tool(pay, kind="read", parameters=hand)
    out = t.invoke({"code": "usd"})
    assert out["status"] == "error" and out["error"] == "InvalidArguments"
    assert "argument 'code': 'usd' does not match '^[A-Z]{3}$'" in out["message"]
    with pytest.raises(ToolError, match="not a valid JSON Schema"):
        tool(pay, kind="read", parameters={"type": "object", "properties": {"code": {"type": 5}}})
