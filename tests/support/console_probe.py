"""Imported as an actor's module by the console tests: does at import what $CONSOLE_PROBE names, then stops.

Has no actor class, so a context naming `tests.support.console_probe:Missing` ends right after this import with
exit code 2, which is all the tests need: whatever the work printed reached the actor's stderr, through the same
start-up path (`actors.runtime.main`, fresh or forked from the template) as a real actor's.

* `load_model`: save and load a Hugging Face model, as a learner and a rollout worker do ($CONSOLE_PROBE_MODEL).
* `lost_peer`: form a gloo world of two with a helper process that hosts its store (as the learner hosts the
  weight group's), kill the helper, and wait on the store, as a rollout worker waits for the next weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta

HOST = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=0, world_size=2)
dist.all_reduce(torch.ones(2))
time.sleep(600)
"""


def load_model() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.environ["CONSOLE_PROBE_MODEL"])
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        AutoModelForCausalLM.from_pretrained(saved)
    print("probe: model saved and loaded", file=sys.stderr, flush=True)


def lost_peer() -> None:
    import torch
    import torch.distributed as dist

    from bus.address import free_port

    port = free_port("127.0.0.1")
    host = subprocess.Popen([sys.executable, "-c", HOST, str(port)])
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    dist.all_reduce(torch.ones(2))
    os.kill(host.pid, signal.SIGKILL)
    host.wait()
    try:
        store.get("weights/next")
    except Exception as error:  # what the actor would do: report it on a line of its own
        print(f"probe: lost the peer: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


{"load_model": load_model, "lost_peer": lost_peer}[os.environ["CONSOLE_PROBE"]]()
