"""slime's RL math loaded from its source tree and compared with ours, function by function."""
