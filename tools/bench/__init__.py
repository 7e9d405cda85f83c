"""Benchmarks: each prints a table with its baseline measured in the same run (README's benchmark table)."""
