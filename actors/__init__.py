"""The roles of a run and what they share. Importing the package lets modules that moved still be imported from
their old names (`actors.moved`), so users' plugins keep loading across renovations."""

from actors.moved import install as _answer_moved_module_names

_answer_moved_module_names()
