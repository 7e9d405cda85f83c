"""Plugins users copy from: environments, rollout functions and rewards, loaded by dotted path."""
