"""The actor runtime every role stands on: base class, handlers, process entry point, supervisor, placement."""
