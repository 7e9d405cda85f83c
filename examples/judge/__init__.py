"""An LLM judge as an actor of its own, and the reward function that asks it: see docs/custom-actors.md."""
