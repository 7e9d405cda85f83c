"""Starting a node's actors, used only by `launcher.py`: where the scheduler put this node, which roles and engines
it runs on which GPUs, the template process actors fork from, the supervisor that restarts them, and resuming."""
