"""Renders ``bus.schema`` as Markdown: the generated half of docs/wire-protocol.md.

python -m bus.schema_doc                                   # print the rendering
python -m bus.schema_doc --update docs/wire-protocol.md    # rewrite the generated section
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from bus.schema import MESSAGE_TYPES, RECORD_TYPES, SCHEMA_VERSION

# ---------------------------------------------------------------------------------------------------------------

BEGIN_MARKER = "<!-- BEGIN GENERATED SCHEMA: python -m bus.schema_doc --update docs/wire-protocol.md -->"
END_MARKER = "<!-- END GENERATED SCHEMA -->"


def _wire_type(tp: Any) -> str:
    """A language-neutral spelling of a field type."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        for meta in extras:
            if isinstance(meta, msgspec.Meta) and meta.extra and "dtypes" in meta.extra:
                inner = _wire_type(base).replace("ndarray", f"tensor<{'|'.join(meta.extra['dtypes'])}>")
                return inner
        return _wire_type(base)
    if tp is Any:
        return "any"
    if tp is type(None):
        return "nil"
    if tp is np.ndarray:
        return "ndarray"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_wire_type(arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(f'"{value}"' for value in typing.get_args(tp))
    if origin is list:
        return f"array<{_wire_type(typing.get_args(tp)[0])}>"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"map<{_wire_type(key)}, {_wire_type(value)}>"
    return {str: "str", int: "int", float: "float", bool: "bool"}.get(tp, tp.__name__)


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    if field.default is msgspec.NODEFAULT:
        made = field.default_factory()
        if isinstance(made, np.ndarray):
            return "empty tensor"
        return repr(made)
    value = field.default
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(int(value) if isinstance(value, int) else value)


def _description(tp: Any) -> str:
    if typing.get_origin(tp) is Annotated:
        for meta in typing.get_args(tp)[1:]:
            if isinstance(meta, msgspec.Meta) and meta.description:
                return meta.description
    return ""


def _render_struct(cls: type[msgspec.Struct], heading: str) -> list[str]:
    hints = typing.get_type_hints(cls, include_extras=True)
    lines = [f"{heading} `{cls.__name__}`", "", inspect.cleandoc(cls.__doc__ or ""), ""]
    lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    fields = [f for f in msgspec.structs.fields(cls) if f.name != "v"]
    for field in fields:
        tp = hints[field.name]
        meaning = _description(tp).replace("|", "\\|")
        wire = _wire_type(tp).replace("|", "\\|")
        lines.append(f"| `{field.encode_name}` | `{wire}` | `{_default(field)}` | {meaning} |")
    lines.append("")
    return lines


def render_schema() -> str:
    """Markdown for every message and record: fields, wire types, defaults and meaning."""
    lines = [
        f'Schema version: **{SCHEMA_VERSION}**. Every message map also carries `"type"` (the name below) and',
        '`"v"` (the schema version); they are not repeated in the tables.',
        "",
    ]
    for cls in MESSAGE_TYPES.values():
        lines += _render_struct(cls, "####")
    lines += ["### Nested records", "", "Plain maps inside messages; no `type`, no `v`.", ""]
    for cls in RECORD_TYPES.values():
        lines += _render_struct(cls, "####")
    return "\n".join(lines).rstrip() + "\n"


def update_document(path: Path) -> bool:
    """Replace the generated section of ``path``; return whether the file changed."""
    text = path.read_text()
    start, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"{path}: markers {BEGIN_MARKER!r} ... {END_MARKER!r} not found")
    new = text[: start + len(BEGIN_MARKER)] + "\n\n" + render_schema() + "\n" + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def generated_section(text: str) -> str:
    """The generated part of a document, as ``update_document`` writes it."""
    start, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        return ""
    return text[start + len(BEGIN_MARKER) : end].strip("\n") + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--update":
        changed = update_document(Path(sys.argv[2]))
        print(f"{sys.argv[2]}: {'updated' if changed else 'already up to date'}")
    else:
        sys.stdout.write(render_schema())
