"""Imports every built-in reward module so their ``@register_reward`` decorators run (the registry loads this)."""

from policies.rewards import constant, dapo, deepscaler, episodes, geo3k, math_answers, numbers, text, working

__all__ = ["constant", "dapo", "deepscaler", "episodes", "geo3k", "math_answers", "numbers", "text", "working"]
