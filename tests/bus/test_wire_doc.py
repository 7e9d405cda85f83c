"""docs/wire-protocol.md stays in step with bus/schema.py."""

from __future__ import annotations

import typing
from pathlib import Path

import msgspec
import pytest

from bus.schema import MESSAGE_TYPES, RECORD_TYPES
from bus.schema_doc import generated_section, render_schema

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-protocol.md"


@pytest.mark.unit
def test_the_documents_schema_section_is_the_current_rendering() -> None:
    assert generated_section(DOC.read_text()) == render_schema(), (
        "docs/wire-protocol.md is stale: run python -m bus.schema_doc --update docs/wire-protocol.md"
    )


@pytest.mark.unit
@pytest.mark.parametrize("struct", [*MESSAGE_TYPES.values(), *RECORD_TYPES.values()], ids=lambda t: t.__name__)
def test_every_type_and_field_is_documented_with_a_meaning(struct: type[msgspec.Struct]) -> None:
    rendering = render_schema()
    assert f"#### `{struct.__name__}`" in rendering
    hints = typing.get_type_hints(struct, include_extras=True)
    for field in msgspec.structs.fields(struct):
        if field.name == "v":
            continue
        metadata = [m for m in typing.get_args(hints[field.name])[1:] if isinstance(m, msgspec.Meta)]
        assert metadata and metadata[0].description, f"{struct.__name__}.{field.name} has no doc(...)"
        assert f"| `{field.encode_name}` |" in rendering
