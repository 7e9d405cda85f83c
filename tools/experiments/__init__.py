"""Experiments whose results the docs report (staleness and off-policy corrections), and their tables and plots."""
