"""A learner of several processes: rank 0 hosts the world's store on the node's address, not on every interface."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from actors.config import build_config
from actors.learner import ranks as ranks_module
from actors.learner.ranks import LearnerRanks
from bus.address import free_port
from tests.support.inprocess import use_spec
from tests.support.sockets import listening
from tools.sim.pipeline import SimSpec


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_learner_ranks_form_their_world_listening_on_the_node_address_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SimSpec(), tmp_path, monkeypatch)  # the follower builds the sleeping trainer from the same spec
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer", "learner_ranks": 2})
    ranks = LearnerRanks(config, tmp_path, "127.0.0.1", structlog.get_logger())
    before = listening()
    try:
        ranks.spawn()
        ranks.join()
        ours = listening() - before
    finally:
        ranks.close()
    assert ours and {address for address, _ in ours} == {"127.0.0.1"}, f"rank 0 listens on {sorted(ours)}"


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_rank_zero_of_a_learner_on_two_nodes_names_the_node_whose_ranks_never_came(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher runs on node 1: rank 0's start fails at its deadline, naming the node and the address it waited
    at, instead of waiting in `init_process_group` for the 30-minute collective timeout."""
    use_spec(SimSpec(), tmp_path, monkeypatch)
    monkeypatch.setattr(ranks_module, "REMOTE_JOIN_TIMEOUT_S", 1.0)
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer", "actor_num_nodes": 2,
                           "actor_num_gpus_per_node": 1, "learner_world_address": address})
    ranks = LearnerRanks(config, tmp_path, "127.0.0.1", structlog.get_logger())
    try:
        ranks.spawn()
        assert ranks.followers == []  # the head's only rank is rank 0 itself
        with pytest.raises(RuntimeError, match=rf"learner ranks \[1\] \(node 1\) did not reach rank 0's store at "
                                               rf"{address} within 1 s: run `launcher.py --node-rank N`"):
            ranks.join()
    finally:
        ranks.close()
