"""The reward role: scores generated samples with the configured reward functions."""
