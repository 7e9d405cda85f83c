"""`python -m tools.standins.sglang_server`: the server as a process of its own, which leaves without tearing torch's
and transformers' modules down (~1 s that the worker stopping it waited, at the end of every run on these servers;
its grace before SIGKILL is 1 s). Only as a process of its own: a benchmark's server forked from the benchmark
(tools/bench/forked_server.py) calls `main` and would run the benchmark's exit handlers too, one of which deletes its
scratch folder (a `TemporaryDirectory`), which holds the model and the log of its next server."""

from engines.process import exit_now
from tools.standins.sglang_server.server import main

main()
exit_now(0)
