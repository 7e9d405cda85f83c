"""Hostile input on every bound socket of a live run: the plan, the attack, the judge."""
