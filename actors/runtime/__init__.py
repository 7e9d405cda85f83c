"""The actor runtime every role stands on: the base class, its handlers, the process entry point, the supervisor, placement."""
