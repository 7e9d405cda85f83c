"""Imports every built-in reward module so their ``@register_reward`` decorators run (the registry loads this)."""

from policies.rewards import deepscaler, episodes, math_answers, numbers, text

__all__ = ["deepscaler", "episodes", "math_answers", "numbers", "text"]
