"""The actor process runtime every role stands on: base class, handlers, process entry point, peers, metrics.

Starting a node's processes lives in `actors.launch` and the end-of-run report in `actors.report`; this package
imports neither, so an actor process never loads the launcher's machinery."""
