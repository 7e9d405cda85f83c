"""The controller role: the roster, the run's lifecycle, eval rounds and the W&B mirror."""
