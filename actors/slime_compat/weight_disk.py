"""slime's `--custom-update-weight-post-write-path` hook, as the disk weight transport calls it.

slime calls `hook(args, version_dir, rollout_engines)` on every trainer rank once a disk sync's files are written and
before the engines read them (an object-store-backed filesystem publishes the writes there). Here only learner rank 0
writes, so the hook runs there, once per push; `rollout_engines` are the receiving rollout workers' names (slime's are
Ray actor handles, which do not exist here), and `args` is the namespace every slime-style plugin receives, with
slime's own names of the disk settings set.
"""

from __future__ import annotations

from collections.abc import Callable

from actors.config import RunConfig
from actors.slime_compat.args import build_args
from policies.plugins import load_callable

FLAG = "--weight-disk-post-write-path"


def post_write_hook(config: RunConfig) -> Callable[[str, tuple[str, ...]], None] | None:
    """The run's hook as the disk transport calls it, `(version_dir, engines)`; None when there is none. A path that
    does not load fails here, at the learner's start."""
    weights = config.weights
    if not weights.weight_disk_post_write_path:
        return None
    fn = load_callable(weights.weight_disk_post_write_path, what=FLAG)
    args = build_args(config)
    args.update_weight_transport = "disk"
    args.update_weight_disk_dir = weights.weight_disk_dir
    args.update_weight_disk_keep_files = weights.weight_disk_keep_files
    args.update_weight_local_checkpoint_dir = weights.weight_disk_local_dir

    def hook(version_dir: str, engines: tuple[str, ...]) -> None:
        fn(args, version_dir, list(engines))

    return hook
