"""SGLang as the rollout engine: an HTTP client (`client.py`), the process launcher (`launch.py`), the
learner-side weight sender (`weights.py`), and an SGLang-compatible server over the torch engine (`server.py`)
so that the whole path runs, and is tested, on machines without a GPU."""
