"""Run plugins written for slime: a slime-style ``Sample``, ``args``, HTTP helpers and signature adapters.

The change a slime plugin needs is its imports: ``from slime.utils.types import Sample`` becomes
``from actors.slime_compat import Sample`` (likewise ``post`` from ``slime.utils.http_utils``, ``GenerateState``
from ``slime.rollout.sglang_rollout``, ``DynamicFilterOutput`` from ``slime.rollout.filter_hub.base_types``,
``pop_first`` from ``slime.rollout.data_source``, ``run`` from ``slime.utils.async_utils``,
``RolloutFnTrainOutput`` from ``slime.rollout.base_types``, ``DataSource`` from ``slime.rollout.data_source``).
Signatures stay slime's; ``plugins`` detects them and adapts them onto the actors' seams.
"""

from actors.slime_compat.args import build_args, sampling_params
from actors.slime_compat.async_loop import run
from actors.slime_compat.data_source import pop_first
from actors.slime_compat.http import get, post
from actors.slime_compat.plugins import DynamicFilterOutput, is_slime_style
from actors.slime_compat.prompt_source import DataSource
from actors.slime_compat.rollout_function import RolloutFnEvalOutput, RolloutFnTrainOutput
from actors.slime_compat.sample import Sample
from actors.slime_compat.state import GenerateState, load_tokenizer

__all__ = ["DataSource", "DynamicFilterOutput", "GenerateState", "RolloutFnEvalOutput", "RolloutFnTrainOutput",
           "Sample", "build_args", "get", "is_slime_style", "load_tokenizer", "pop_first", "post", "run",
           "sampling_params"]
