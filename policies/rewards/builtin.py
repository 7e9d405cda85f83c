"""Imports every built-in reward module so their ``@register_reward`` decorators run (the registry loads this)."""

from policies.rewards import deepscaler, math_answers, text

__all__ = ["deepscaler", "math_answers", "text"]
