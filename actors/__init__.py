"""The roles of a run and what they share. Importing the package lets modules that moved still be imported from
their old names (`actors.moved`), so users' plugins keep loading across renovations, and lets slime's plugins import
slime's modules unchanged where slime is not installed (`actors.slime_compat.imports`)."""

from actors.moved import install as _answer_moved_module_names
from actors.slime_compat.imports import install as _answer_slime_module_names

_answer_moved_module_names()
_answer_slime_module_names()
