"""A learner of several processes: rank 0 hosts the world's store on the node's address, not on every interface."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from actors.config import build_config
from actors.learner.ranks import LearnerRanks
from tests.support.inprocess import use_spec
from tests.support.sockets import listening
from tools.pipeline_sim import SimSpec


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_learner_ranks_form_their_world_listening_on_the_node_address_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SimSpec(), tmp_path, monkeypatch)  # the follower builds the sleeping trainer from the same spec
    config = build_config({"train_backend": "tools.pipeline_sim:sleeping_trainer", "learner_ranks": 2})
    ranks = LearnerRanks(config, tmp_path, "127.0.0.1", structlog.get_logger())
    before = listening()
    try:
        ranks.spawn()
        ranks.join()
        ours = listening() - before
    finally:
        ranks.close()
    assert ours and {address for address, _ in ours} == {"127.0.0.1"}, f"rank 0 listens on {sorted(ours)}"
