"""GPU placement: every process gets its devices, slime's placement flags mean what they mean in slime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launcher
from actors.config import build_config, config_from_args
from actors.config.engines import weight_backend
from actors.launch import node_roles
from actors.launch.cluster_env import ClusterNode
from actors.launch.placement import PlacementError, place_node, visible_devices
from actors.learner.publish import transport_name
from bus.address import ephemeral_port_range
from engines.weights.names import SGLANG_LORA, SGLANG_TENSOR
from tests.support.http_apps import served
from tests.support.launch_inputs import minimal_inputs
from tools.bench.pipeline import SLEEPING_FLAGS
from tools.standins.sglang_router import RouterStandIn


@pytest.mark.unit
def test_exclusive_layout_gives_learner_the_first_gpus_and_each_engine_its_own() -> None:
    placement = place_node(gpus=8, learner_ranks=4, rollout_workers=2, gpus_per_engine=2, rollout_engine="sglang")
    assert placement.learner == (0, 1, 2, 3)
    assert placement.rollout == ((4, 5), (6, 7))
    assert not placement.shared
    assert weight_backend(cuda=True, shared=placement.shared) == "nccl"


@pytest.mark.unit
def test_one_gpu_shares_the_learners_device_with_torch_engines_over_cuda_ipc() -> None:
    placement = place_node(gpus=1, learner_ranks=1, rollout_workers=2, gpus_per_engine=1, rollout_engine="torch")
    assert placement.learner == (0,)
    assert placement.rollout == ((0,), (0,))
    assert placement.shared
    assert weight_backend(cuda=True, shared=placement.shared) == "cuda_ipc"
    assert "CUDA IPC" in placement.describe()


@pytest.mark.unit
def test_too_few_gpus_is_an_error_that_gives_the_counts() -> None:
    with pytest.raises(PlacementError, match=r"has 1 GPUs but its actors need 2.*SGLang server needs GPUs"):
        place_node(gpus=1, learner_ranks=1, rollout_workers=1, gpus_per_engine=1, rollout_engine="sglang")
    with pytest.raises(PlacementError, match=r"learner needs 4 GPUs.*has 2"):
        place_node(gpus=2, learner_ranks=4, rollout_workers=0, gpus_per_engine=1, rollout_engine="torch")
    with pytest.raises(PlacementError, match=r"has 2 GPUs but its actors need 3"):  # worker node: nothing to share
        place_node(gpus=2, learner_ranks=0, rollout_workers=3, gpus_per_engine=1, rollout_engine="torch")


@pytest.mark.unit
def test_an_engine_that_needs_no_gpu_takes_none_and_leaves_the_learner_its_own() -> None:
    placement = place_node(gpus=1, learner_ranks=1, rollout_workers=4, gpus_per_engine=1,
                           rollout_engine="tools.sim.pipeline:sleeping_engine", rollout_needs_gpu=False)
    assert placement.learner == (0,) and placement.rollout == ((), (), (), ())
    assert not placement.shared
    assert "rollout worker 3 on no GPU" in placement.describe()
    with pytest.raises(PlacementError, match=r"learner needs 2 GPUs.*has 1"):  # the learner's own need still holds
        place_node(gpus=1, learner_ranks=2, rollout_workers=4, gpus_per_engine=1, rollout_engine="m:f",
                   rollout_needs_gpu=False)


@pytest.mark.unit
def test_no_gpu_means_everything_on_the_cpu_over_gloo() -> None:
    placement = place_node(gpus=0, learner_ranks=2, rollout_workers=3, gpus_per_engine=4, rollout_engine="sglang")
    assert placement.learner == () and placement.rollout == ((), (), ())
    assert weight_backend(cuda=False, shared=placement.shared) == "gloo"


@pytest.mark.unit
def test_visible_devices_follow_the_launchers_own_allocation() -> None:
    assert visible_devices((0, 1), None) == "0,1"
    assert visible_devices((1, 2), "4,5,6,7") == "5,6"  # a Slurm allocation of GPUs 4-7
    with pytest.raises(PlacementError, match=r"GPU 2 asked for.*lists only 2"):
        visible_devices((2,), "4,5")


@pytest.mark.unit
def test_slime_actor_gpus_set_the_learner_ranks_and_must_agree_with_them() -> None:
    assert build_config({"actor_num_nodes": 1, "actor_num_gpus_per_node": 4}).trainer.learner_ranks == 4
    with pytest.raises(ValueError, match=r"learner_ranks 2 disagrees.*= 4"):
        build_config({"actor_num_gpus_per_node": 4, "learner_ranks": 2})
    assert build_config({"actor_num_nodes": 2, "actor_num_gpus_per_node": 4}).trainer.learner_ranks == 8
    with pytest.raises(ValueError, match=r"learner_ranks 3 must be a multiple of actor_num_nodes 2"):
        build_config({"actor_num_nodes": 2, "learner_ranks": 3})
    with pytest.raises(ValueError, match=r"colocate with actor_num_nodes > 1"):
        build_config({"actor_num_nodes": 2, "actor_num_gpus_per_node": 1, "colocate": True})
    with pytest.raises(ValueError, match=r"learner_world_address 'head:29500': expected tcp://HOST:PORT"):
        build_config({"actor_num_nodes": 2, "actor_num_gpus_per_node": 1, "learner_world_address": "head:29500"})
    with pytest.raises(ValueError, match=r"rollout_num_gpus 3 must be a multiple"):
        build_config({"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2})


@pytest.mark.unit
def test_colocate_is_on_policy_and_refuses_what_would_not_take_turns() -> None:
    assert build_config({"colocate": True}).buffer.max_staleness == 0
    with pytest.raises(ValueError, match=r"colocate: max_staleness 2; colocated runs are on-policy"):
        build_config({"colocate": True, "max_staleness": 2})
    with pytest.raises(ValueError, match=r"colocate: --weight-transport gloo broadcasts"):
        build_config({"colocate": True, "weight_transport": "gloo"})
    with pytest.raises(ValueError, match=r"colocate: --rollout-engine tests.x:y; colocated mode runs torch "
                                         "engines or SGLang servers"):
        build_config({"colocate": True, "rollout_engine": "tests.x:y"})
    sglang = build_config({"colocate": True, "rollout_engine": "sglang"})
    assert transport_name(sglang) == SGLANG_TENSOR  # by reference to the learner's memory, not a broadcast
    assert transport_name(build_config({"colocate": True, "rollout_engine": "sglang", "lora_rank": 8})) == SGLANG_LORA


@pytest.mark.unit
def test_colocate_puts_every_engine_on_the_learners_gpu_and_reads_its_memory() -> None:
    placement = place_node(gpus=8, learner_ranks=1, rollout_workers=3, gpus_per_engine=1, rollout_engine="torch",
                           colocate=True)
    assert placement.learner == (0,) and placement.rollout == ((0,), (0,), (0,)) and placement.shared
    assert weight_backend(cuda=True, shared=placement.shared, colocate=True) == "cuda_ipc"
    assert weight_backend(cuda=False, shared=False, colocate=True) == "shm"
    assert weight_backend(cuda=False, shared=False) == "gloo"
    servers = place_node(gpus=8, learner_ranks=1, rollout_workers=2, gpus_per_engine=1, rollout_engine="sglang",
                         colocate=True)
    assert servers.rollout == ((0,), (0,)) and servers.shared
    with pytest.raises(PlacementError, match=r"colocate: --rollout-num-gpus-per-engine 2; a colocated engine"):
        place_node(gpus=8, learner_ranks=1, rollout_workers=1, gpus_per_engine=2, rollout_engine="sglang",
                   colocate=True)
    with pytest.raises(PlacementError, match=r"colocate: 2 learner ranks"):
        place_node(gpus=8, learner_ranks=2, rollout_workers=1, gpus_per_engine=1, rollout_engine="torch",
                   colocate=True)
    cpu_only = place_node(gpus=0, learner_ranks=1, rollout_workers=2, gpus_per_engine=1, rollout_engine="torch",
                          colocate=True)
    assert cpu_only.rollout == ((), ())


def _prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, *flags: str) -> tuple[list, Path]:
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    contexts, _, run_dir = launcher.prepare(["--head", "--run-dir", str(tmp_path / "run"), *minimal_inputs(tmp_path),
                                             *flags])
    return contexts, run_dir


@pytest.mark.unit
def test_launcher_hands_each_actor_its_gpus_and_records_the_transport(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contexts, run_dir = _prepare(tmp_path, monkeypatch, 8, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus",
                                 "4", "--rollout-num-gpus-per-engine", "2", "--rollout-engine", "sglang")
    devices = {context.actor_id: context.cuda_visible_devices for context in contexts}
    assert devices == {"controller": "", "buffer": "", "learner": "0,1", "rollout-0-0": "2,3",
                       "rollout-0-1": "4,5", "reward-0-0": ""}
    run = json.loads(contexts[0].to_json())["settings"]["run"]
    assert run["trainer"]["learner_ranks"] == 2 and run["weights"]["weight_transport"] == "nccl"
    assert "weight_transport: nccl" in (run_dir / "config.yaml").read_text()


@pytest.mark.unit
def test_launcher_on_one_gpu_shares_it_and_on_none_leaves_cuda_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contexts, _ = _prepare(tmp_path, monkeypatch, 1, "--rollout-workers", "2")
    assert {c.actor_id: c.cuda_visible_devices for c in contexts if c.role in ("learner", "rollout")} == {
        "learner": "0", "rollout-0-0": "0", "rollout-0-1": "0"}
    assert contexts[0].settings.run.weights.weight_transport == "cuda_ipc"
    contexts, _ = _prepare(tmp_path, monkeypatch, 0, "--rollout-workers", "2")
    assert all(c.cuda_visible_devices is None for c in contexts)
    assert contexts[0].settings.run.weights.weight_transport == "gloo"


@pytest.mark.unit
def test_launcher_on_one_gpu_gives_a_plugin_engine_that_needs_none_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline benchmark on a one-GPU machine: four sleeping engines used to ask for four GPUs and fail."""
    contexts, _ = _prepare(tmp_path, monkeypatch, 1, "--rollout-workers", "4", *SLEEPING_FLAGS)
    assert {c.actor_id: c.cuda_visible_devices for c in contexts if c.role in ("learner", "rollout")} == {
        "learner": "0", "rollout-0-0": "", "rollout-0-1": "", "rollout-0-2": "", "rollout-0-3": ""}


@pytest.mark.unit
def test_engines_that_hold_no_gpu_take_their_weights_over_gloo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "remote_engine.py").write_text("def factory(config, actor_id):\n    pass\nfactory.needs_gpu = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    contexts, _ = _prepare(tmp_path, monkeypatch, 1, "--rollout-engine", "remote_engine:factory")
    assert contexts[0].settings.run.weights.weight_transport == "gloo"  # NCCL needs a GPU at both ends


@pytest.mark.unit
def test_an_engine_plugins_needs_gpu_must_be_a_bool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vague_engine.py").write_text("def factory(config, actor_id):\n    pass\nfactory.needs_gpu = 'no'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(launcher.LaunchError, match=r"placement: --rollout-engine 'vague_engine:factory': needs_gpu is "
                                                   r"str 'no', expected True or False"):
        _prepare(tmp_path, monkeypatch, 1, "--rollout-engine", "vague_engine:factory")


@pytest.mark.unit
def test_launcher_refuses_a_placement_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(launcher.LaunchError, match=r"placement: .*SGLang server needs GPUs of its own"):
        _prepare(tmp_path, monkeypatch, 1, "--rollout-engine", "sglang")


@pytest.mark.unit
def test_every_sglang_server_gets_its_own_seed() -> None:
    from actors.rollout.engine_factory import engine_seed

    ids = [f"rollout-{node}-{index}" for node in range(3) for index in range(8)]
    seeds = [engine_seed(1234, actor_id) for actor_id in ids]
    assert len(set(seeds)) == len(ids)
    assert engine_seed(1234, "rollout-0-0") == 1234


@pytest.mark.unit
def test_a_worker_node_runs_an_engine_per_gpus_per_engine_and_the_head_expects_as_many_of_each_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 8)
    args = launcher.build_parser().parse_args([*minimal_inputs(tmp_path), "--rollout-engine", "sglang",
                                               "--rollout-num-gpus-per-engine", "2"])
    config = config_from_args(args)
    assert node_roles.default_rollout_workers(config, head=False) == 4
    assert node_roles.default_rollout_workers(config, head=True) == 1  # no --rollout-num-gpus: the head's GPUs train
    head_of_three = ClusterNode(scheduler="slurm", rank=0, nodes=3, head_host="gpu01", head_port=21234)
    assert node_roles.worker_node_roles(args, {}, head_of_three.nodes, config) == {"rollout": 8, "reward": 2}
    capped = config_from_args(launcher.build_parser().parse_args(
        [*minimal_inputs(tmp_path), "--rollout-engine", "sglang", "--num-gpus-per-node", "4"]))
    assert node_roles.default_rollout_workers(capped, head=False) == 4
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 0)
    assert node_roles.default_rollout_workers(config, head=False) == 1


@pytest.mark.unit
def test_a_learner_on_two_nodes_takes_the_first_gpus_of_each_and_meets_at_an_address_the_head_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contexts, _ = _prepare(tmp_path, monkeypatch, 8, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4",
                           "--rollout-num-gpus", "4")
    devices = {context.actor_id: context.cuda_visible_devices for context in contexts}
    assert devices["learner"] == "0,1,2,3" and devices["rollout-0-0"] == "4"
    config = contexts[0].settings.run
    assert config.trainer.learner_ranks == 8
    address = config.placement.learner_world_address
    assert address is not None and address.startswith("tcp://127.0.0.1:")  # every node's settings carry it
    # below the ports outgoing connections are given, which could take it before rank 0 binds it (at any restart)
    assert int(address.rsplit(":", 1)[1]) < ephemeral_port_range()[0]

    # Node 1 of the learner: its four ranks first, then an engine per --rollout-num-gpus-per-engine of the rest.
    args = launcher.build_parser().parse_args(["--node-rank", "1", "--head-address", "tcp://127.0.0.1:1",
                                               *minimal_inputs(tmp_path), "--rollout-num-gpus-per-engine", "2"])
    args.host = "127.0.0.1"
    node = config.with_settings(rollout_num_gpus_per_engine=2)
    assert node_roles.default_rollout_workers(node, head=False, learner_node=True) == 2
    assert node_roles.default_rollout_workers(node, head=False) == 4  # a node outside the learner
    contexts, _ = launcher.plan_actors(args, {}, {"learner-ranks": 1, "rollout": 2}, "tcp://127.0.0.1:1",
                                       tmp_path / "run", node)
    assert {context.actor_id: context.cuda_visible_devices for context in contexts} == {
        "learner-ranks-1-0": "0,1,2,3", "rollout-1-0": "4,5", "rollout-1-1": "6,7"}
    assert contexts[0].actor_class == "actors.learner.remote_ranks:RemoteLearnerRanks"


@pytest.mark.unit
def test_the_head_of_a_scheduled_job_expects_each_learner_nodes_ranks_and_only_the_engines_they_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four 8-GPU nodes, a learner on the first two: node 1 runs its learner ranks and the 2 engines its 4 free GPUs
    hold (2 GPUs each), nodes 2 and 3 run 4 engines each. The head counted 4 engines and no ranks on node 1, so a
    run whose every actor had registered stayed "starting" (with the start-up hang limit) and named engines
    that were never to exist as missing."""
    contexts, _ = _prepare(tmp_path, monkeypatch, 8, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4",
                           "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    config = contexts[0].settings.run
    args = launcher.build_parser().parse_args(["--head", *minimal_inputs(tmp_path)])
    assert node_roles.worker_node_roles(args, {}, 4, config) == {"learner-ranks": 1, "rollout": 2 + 4 + 4,
                                                                 "reward": 3}
    expected = next(context for context in contexts if context.role == "controller").settings.expected_roles
    assert expected == {"buffer": 1, "learner": 1, "rollout": 2, "reward": 1}  # no scheduler here: one node


@pytest.mark.unit
def test_a_learner_rank_binds_its_own_gpu_index_which_the_torch_trainer_resolves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the learner's visible GPUs rank r owns cuda:r: `bind_device` records it as LOCAL_RANK (and sets the
    device where CUDA exists), and the torch trainer's "cuda" means that one. On this CPU machine nothing binds."""
    from actors.learner.ranks import bind_device
    from engines.training.torch_trainer import _resolve_device

    monkeypatch.setenv("LOCAL_RANK", "0")  # recorded, so bind_device's value is undone after the test
    assert _resolve_device("cuda").index == 0
    bind_device(3)
    assert _resolve_device("cuda").index == 3
    assert _resolve_device("cpu").type == "cpu"


@pytest.mark.unit
def test_the_head_starts_an_evaluator_only_for_a_run_with_eval_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held_out = tmp_path / "held.jsonl"
    held_out.write_text('{"input": "1+1=", "label": "2"}\n')
    plain, _ = _prepare(tmp_path, monkeypatch, 0)
    assert "evaluator" not in {context.role for context in plain}
    evaluated, _ = _prepare(tmp_path, monkeypatch, 0, "--eval-prompt-data", "held", str(held_out),
                            "--eval-interval", "2")
    evaluator = next(context for context in evaluated if context.role == "evaluator")
    assert (evaluator.actor_id, evaluator.cuda_visible_devices) == ("evaluator", None)
    controller = next(context for context in evaluated if context.role == "controller")
    assert controller.settings.expected_roles["evaluator"] == 1  # the run waits for it to register
    assert [context.role for context in evaluated][:4] == ["controller", "buffer", "evaluator", "learner"]


@pytest.mark.unit
def test_attached_servers_get_a_rollout_worker_each_and_a_node_given_the_router_none(tmp_path: Path) -> None:
    attached = build_config({"rollout_engine": "sglang", "sglang_url": ["http://a:1", "http://b:2", "http://c:3"],
                             "rollout_num_gpus": 8})
    assert node_roles.default_rollout_workers(attached, head=True) == 3
    assert node_roles.default_rollout_workers(attached, head=False) == 3
    routed = build_config({"rollout_engine": "sglang", "sglang_router_url": "http://router:3000"})
    assert node_roles.default_rollout_workers(routed, head=False) == 0  # the head's workers attach to them all


@pytest.mark.integration
def test_the_head_attaches_a_rollout_worker_to_each_server_its_router_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    router = RouterStandIn(["http://127.0.0.1:30002", "http://127.0.0.1:30001"])
    router.register("http://127.0.0.1:30003")["is_healthy"] = False
    with served(router.app()) as url:
        port = url.rsplit(":", 1)[1]
        slime_flags = ("--sglang-router-ip", "127.0.0.1", "--sglang-router-port", port, "--rollout-num-gpus", "8")
        contexts, run_dir = _prepare(tmp_path, monkeypatch, 0, *slime_flags)
        rollout = [context for context in contexts if context.role == "rollout"]
        assert [context.actor_id for context in rollout] == ["rollout-0-0", "rollout-0-1"]
        servers = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
        assert all(context.settings.run.engine.sglang_url == servers for context in rollout)
        assert contexts[0].settings.run.engine.sglang_router_url is None  # the router is out of the way
        assert "http://127.0.0.1:30001\n  - http://127.0.0.1:30002" in (run_dir / "config.yaml").read_text()
        said = capsys.readouterr().err
        assert f"sglang-router {url} lists 2 SGLang server(s)" in said
        assert "left out as unhealthy: http://127.0.0.1:30003" in said

        with pytest.raises(launcher.LaunchError, match=r"--rollout-workers 3, but sglang-router .* lists 2 server"):
            _prepare(tmp_path, monkeypatch, 0, *slime_flags, "--rollout-workers", "3")
        router.workers.clear()
        with pytest.raises(launcher.LaunchError, match=f"sglang-router {url}: no SGLang server to attach to within "
                                                       "0.5s: it lists no workers"):
            _prepare(tmp_path, monkeypatch, 0, *slime_flags, "--sglang-router-timeout", "0.5")
