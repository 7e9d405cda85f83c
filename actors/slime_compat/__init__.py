"""Run plugins written for slime: a slime-style ``Sample``, ``args``, HTTP helpers and signature adapters.

A slime plugin imports unchanged: ``from slime.utils.types import Sample`` (likewise ``post`` from
``slime.utils.http_utils``, ``GenerateState`` from ``slime.rollout.sglang_rollout``, ``batched_async_rm`` from
``slime.rollout.rm_hub``, ``load_function`` from ``slime.utils.misc`` ...) is answered with ours when slime itself is
not installed (``imports``: the modules and names offered). Code of ours imports them from here:
``from actors.slime_compat import Sample``. Signatures stay slime's; ``plugins`` detects them and adapts them onto
the actors' seams.

The names below load at first use: importing `actors` imports this package (to install the import shim), and a
process without slime plugins should not pay for their adapters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.slime_compat.args import build_args, sampling_params
    from actors.slime_compat.async_loop import run
    from actors.slime_compat.data_source import pop_first
    from actors.slime_compat.http import get, post
    from actors.slime_compat.plugins import DynamicFilterOutput, is_slime_style
    from actors.slime_compat.prompt_source import DataSource
    from actors.slime_compat.rollout_function import RolloutFnEvalOutput, RolloutFnTrainOutput
    from actors.slime_compat.sample import Sample
    from actors.slime_compat.state import GenerateState, load_tokenizer

_WHERE = {
    "build_args": "args", "sampling_params": "args", "run": "async_loop", "pop_first": "data_source", "get": "http",
    "post": "http", "DynamicFilterOutput": "plugins", "is_slime_style": "plugins", "DataSource": "prompt_source",
    "RolloutFnEvalOutput": "rollout_function", "RolloutFnTrainOutput": "rollout_function", "Sample": "sample",
    "GenerateState": "state", "load_tokenizer": "state",
}

__all__ = ["DataSource", "DynamicFilterOutput", "GenerateState", "RolloutFnEvalOutput", "RolloutFnTrainOutput",
           "Sample", "build_args", "get", "is_slime_style", "load_tokenizer", "pop_first", "post", "run",
           "sampling_params"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
