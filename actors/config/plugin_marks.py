"""The mark a plugin setting carries on its field, so the launcher's preflight knows who loads it without a table."""

from __future__ import annotations

from typing import Any

PLUGIN_FOR = "plugin_for"  # the key of a plugin setting's mark in its field's json_schema_extra


def plugin_for(*roles: str, builtins: tuple[str, ...] = (), builder: str | None = None) -> dict[str, Any]:
    """A plugin setting's mark (a field's `json_schema_extra`): the roles whose actors load it, so the launcher's
    preflight imports it on the nodes that run them and nowhere else. `builtins`: values that name no plugin (a
    field with `BuiltinNames` says so there). `builder`: the `actors.extensions.load` function `(config) -> ...`
    that builds it as its role does, for a setting that is a registry name or a path (a reward, a filter)."""
    return {PLUGIN_FOR: roles, "builtins": builtins, "builder": builder}
