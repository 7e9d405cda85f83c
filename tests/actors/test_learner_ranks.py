"""The learner's ranks: a world of several processes listens on the node's address only; one rank sends no frame."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from actors.config import build_config
from actors.learner import ranks as ranks_module
from actors.learner.ranks import BEAT_S, CollectiveTrainer, LearnerRanks, silent_after
from actors.learner.step import TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.address import free_port
from bus.codec import encode
from bus.schema import Batch, Sample
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


@pytest.mark.integration
def test_a_one_rank_learner_trains_the_batch_as_it_holds_it_without_encoding_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The frame is the followers' copy of the batch; with no follower none is made. A value the wire cannot
    carry shows it: encoding would refuse the batch, training it does not read the value."""
    use_spec(SimSpec(train_sample_seconds=0.0), tmp_path, monkeypatch)
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer", "loss_type": "sft"})
    sample = Sample(sample_id="g/0", group_id="g", index=0, prompt="p", prompt_tokens=1, tokens=[1, 2, 3],
                    response_length=2, metadata={"unsendable": object()})
    batch = Batch(batch_id=1, samples=[sample], staleness=[0])
    with pytest.raises(TypeError, match="cannot encode"):
        encode(batch)
    trainer = CollectiveTrainer(build_trainer(config), LearnerRanks(config, tmp_path, "127.0.0.1",
                                                                    structlog.get_logger()))
    report = trainer.train(TrainingStep(trainer.local, config), batch)
    assert report.result.version == 1


@pytest.mark.unit
def test_another_nodes_silent_rank_is_given_up_on_after_the_runs_heartbeat_setting_and_never_sooner_than_20_beats(
        ) -> None:
    """A run with slow heartbeats tolerates a longer silence; fast heartbeats (the system tests' 0.25 s) do not
    shorten it below 20 of the followers' beats, which a loaded machine's model builds and group set-ups need."""
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer"})
    assert LearnerRanks(config, Path("."), "127.0.0.1", structlog.get_logger()).silent_s == 20.0
    fast = LearnerRanks(config, Path("."), "127.0.0.1", structlog.get_logger(), heartbeat_interval=0.25)
    assert fast.silent_s == 20 * BEAT_S  # a follower beats once a second, whatever the run's heartbeat
    slow = LearnerRanks(config, Path("."), "127.0.0.1", structlog.get_logger(), heartbeat_interval=3.0)
    assert slow.silent_s == silent_after(3.0) == 60.0
