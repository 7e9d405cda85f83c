"""Expert parallelism changes where experts live, never what the model computes: a tiny Qwen3-MoE takes the same
step at EP=2 as at EP=1, alone and under TP=2 (slime's layout: experts whole on each TP rank, sequence parallel),
with megatron's router losses on; and the Megatron backend's log-probs, steps and recorded routes equal the torch
trainer's, for a tiny Mixtral too.

Each layout runs once in spawned gloo ranks on CPU (as `test_megatron_parity.py` does for the dense layouts),
writing what rank 0 saw; the layouts of one world share one spawn, one after another
(`tests/support/world_runs.py`). EP is carved out of the data-parallel ranks, so each EP=2 layout is compared with
the EP=1 layout of the same world and TP: the same data-parallel shards and micro-batches, hence the same router
losses (they are per micro-batch), only the experts' placement differs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.training import TorchTrainer, TorchTrainerConfig
from engines.training.base import ModelOutputs
from engines.weights.layouts import is_stacked_expert
from tests.support.training import seeded_batch, step_loss
from tests.support.world_runs import WorldRuns
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

TEMPERATURE = 0.9
OPTIMIZER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1.0, "weight_decay": 0.1, "grad_clip": 0.05}
MICRO_BATCH_TOKENS = 60
ROUTER_FLAGS = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}


@dataclass(frozen=True)
class Layout:
    world: int
    tensor_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    resume_at_expert_tensor_parallel: int | None = None  # save after step 1; a fresh process loads so, step 2
    router_losses: bool = True
    family: str = "qwen3_moe"  # or Mixtral: mbridge's names (block_sparse_moe, w1/w3/w2), no norm_topk_prob field


LAYOUTS = {
    "single": Layout(world=1, router_losses=False),
    "single-router-losses": Layout(world=1),
    "dp2": Layout(world=2),
    "dp2-ep2": Layout(world=2, expert_parallel=2),
    "tp2-dp2": Layout(world=4, tensor_parallel=2, expert_tensor_parallel=1),
    "tp2-dp2-ep2": Layout(world=4, tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1,
                          resume_at_expert_tensor_parallel=2),
    "tp2-ep2-etp2": Layout(world=4, tensor_parallel=2, expert_parallel=2),  # megatron's default: experts split too
    "mixtral": Layout(world=1, family="mixtral"),
    "mixtral-dp2-ep2": Layout(world=2, expert_parallel=2, family="mixtral"),
}
EXPERT_PARALLEL_PAIRS = [("dp2-ep2", "dp2"), ("tp2-dp2-ep2", "tp2-dp2"), ("tp2-ep2-etp2", "tp2-dp2")]


def routed_batch() -> list:
    """`seeded_batch()` carrying routes as an engine records them (distinct top-2 experts of 4 per token and layer,
    the last token of each sample without), drawn at random so they differ from the model's own choice."""
    generator = torch.Generator().manual_seed(7)
    return [dataclasses.replace(sample, routed_experts=torch.rand(
        (sample.tokens.numel() - 1, 2, 4), generator=generator).argsort(-1)[..., :2].to(torch.int16))
        for sample in seeded_batch()]


def _trainer(model_path: Path, layout: Layout, expert_tensor_parallel: int | None = None):
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig
    from engines.megatron.model_flags import MegatronFlags

    return MegatronTrainer(MegatronTrainerConfig(
        model_path=model_path,
        tensor_model_parallel_size=layout.tensor_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel or layout.expert_tensor_parallel,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        model_flags=MegatronFlags(flags=ROUTER_FLAGS if layout.router_losses else {}),
        use_routing_replay=True,  # every policy forward records its routes too
        **OPTIMIZER,
    ))


def _run_layout(rank: int, out_dir: Path, model_path: Path, layout_fields: dict) -> None:
    layout = Layout(**layout_fields)
    trainer = _trainer(model_path, layout)
    batch = seeded_batch()
    outputs = trainer.compute_log_probs(batch, temperature=TEMPERATURE)
    replayed = trainer.compute_log_probs(routed_batch(), temperature=TEMPERATURE)
    result = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
    weights = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
    split = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors("checkpoint")}
    summary = {"grad_norm": result.grad_norm, "metrics": result.metrics}
    if layout.resume_at_expert_tensor_parallel is not None:
        trainer.save_checkpoint(out_dir / "checkpoint", {})
        uninterrupted = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
        summary["uninterrupted_grad_norm"] = uninterrupted.grad_norm
        expected = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
        if rank == 0:
            save_file(expected, str(out_dir / "uninterrupted.safetensors"))
    if rank == 0:
        recorded = {f"routes.{index}": routes for index, routes in enumerate(outputs.routed_experts or [])}
        save_file({"log_probs": outputs.log_probs, "replayed": replayed.log_probs, **recorded},
                  str(out_dir / "outputs.safetensors"))
        save_file(weights, str(out_dir / "weights.safetensors"))
        save_file(split, str(out_dir / "checkpoint_layout.safetensors"))
        (out_dir / "summary.json").write_text(json.dumps(summary))
    trainer.close()


def _resume_layout(rank: int, out_dir: Path, model_path: Path, layout_fields: dict) -> None:
    """A fresh process, as after a learner restart, loads the checkpoint at another expert TP, takes step 2."""
    layout = Layout(**layout_fields)
    trainer = _trainer(model_path, layout, expert_tensor_parallel=layout.resume_at_expert_tensor_parallel)
    trainer.load_checkpoint(out_dir / "checkpoint")
    batch = seeded_batch()
    resumed = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
    weights = {name: tensor.contiguous().clone() for name, tensor in trainer.named_tensors()}
    if rank == 0:
        save_file(weights, str(out_dir / "resumed.safetensors"))
        (out_dir / "resumed.json").write_text(json.dumps({"grad_norm": resumed.grad_norm}))
    trainer.close()


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("moe-models")
    return {family: cached_tiny_model(cache, TinyModelSpec(family=family)) for family in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="module")
def runs(model_paths: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's run, shared by the tests that look at it (`WorldRuns`: one spawn per world)."""
    return WorldRuns(
        tmp_path_factory, {name: layout.world for name, layout in LAYOUTS.items()}, _run_layout,
        lambda name: (model_paths[LAYOUTS[name].family], asdict(LAYOUTS[name])), _resume_layout,
        [name for name, layout in LAYOUTS.items() if layout.resume_at_expert_tensor_parallel is not None],
    )


@pytest.fixture(scope="module")
def torch_forwards(model_paths: dict[str, Path]) -> dict[str, dict[str, ModelOutputs]]:
    """The torch trainer's forwards that the layouts of one model family are compared with, computed once."""
    forwards: dict[str, dict[str, ModelOutputs]] = {}
    for family, model_path in model_paths.items():
        trainer = TorchTrainer(TorchTrainerConfig(model_path=model_path, micro_batch_tokens=MICRO_BATCH_TOKENS,
                                                  check_packing=False, **OPTIMIZER))
        recording = TorchTrainer(TorchTrainerConfig(model_path=model_path, micro_batch_tokens=MICRO_BATCH_TOKENS,
                                                    use_routing_replay=True))
        forwards[family] = {
            "own_routes": trainer.compute_log_probs(seeded_batch(), temperature=TEMPERATURE),
            "replayed": trainer.compute_log_probs(routed_batch(), temperature=TEMPERATURE),
            "recording": recording.compute_log_probs(seeded_batch(), temperature=TEMPERATURE),
        }
    return forwards


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("expert_parallel", "reference"), EXPERT_PARALLEL_PAIRS)
def test_expert_parallel_step_equals_the_step_with_every_expert_on_every_rank(
    expert_parallel: str, reference: str, runs: dict
) -> None:
    step = json.loads((runs[expert_parallel] / "summary.json").read_text())
    expected = json.loads((runs[reference] / "summary.json").read_text())
    for key in ("loss", "token_term", "moe/load_balancing_loss", "moe/z_loss"):
        assert step["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5), key
    assert expected["metrics"]["moe/load_balancing_loss"] > 0 and expected["metrics"]["moe/z_loss"] > 0
    assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    for layout in ("weights", "checkpoint_layout"):  # what torch engines load, and what SGLang servers load
        exported = load_file(str(runs[expert_parallel] / f"{layout}.safetensors"))
        reference_weights = load_file(str(runs[reference] / f"{layout}.safetensors"))
        assert exported.keys() == reference_weights.keys()
        for name, tensor in reference_weights.items():
            torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["single", "single-router-losses", "mixtral"])
def test_a_step_equals_the_torch_trainers_step(layout: str, runs: dict, model_paths: dict[str, Path]) -> None:
    """Loss (router losses included), gradient norm and every weight after the step, under the names and shapes
    of the HF model in memory (its experts stacked), which the torch trainer sends and the engines serve."""
    router_losses = ROUTER_FLAGS if LAYOUTS[layout].router_losses else {}
    trainer = TorchTrainer(TorchTrainerConfig(model_path=model_paths[LAYOUTS[layout].family],
                                              micro_batch_tokens=MICRO_BATCH_TOKENS, check_packing=False, **OPTIMIZER,
                                              **router_losses))
    batch = seeded_batch()
    expected = trainer.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
    step = json.loads((runs[layout] / "summary.json").read_text())
    for key in ("loss", *(("moe/load_balancing_loss", "moe/z_loss") if router_losses else ())):
        assert step["metrics"][key] == pytest.approx(expected.metrics[key], rel=1e-5), key
    assert step["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-5)
    exported = load_file(str(runs[layout] / "weights.safetensors"))
    expected_weights = dict(trainer.named_tensors())
    assert {name: tuple(t.shape) for name, t in exported.items()} == {
        name: tuple(t.shape) for name, t in expected_weights.items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in exported)
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    split = load_file(str(runs[layout] / "checkpoint_layout.safetensors"))
    expected_split = dict(trainer.named_tensors("checkpoint"))
    assert split.keys() == expected_split.keys() and not any(is_stacked_expert(name) for name in split)
    assert len(split) > len(exported)  # each expert's projections apart
    for name, tensor in expected_split.items():
        torch.testing.assert_close(split[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["single", "dp2-ep2", "tp2-dp2", "tp2-ep2-etp2", "mixtral-dp2-ep2"])
def test_the_routes_a_policy_forward_records_are_the_torch_trainers(layout: str, runs: dict,
                                                                   torch_forwards: dict) -> None:
    """--use-routing-replay (slime's R2): what each token routed to in the pi_old forward, assembled from every
    rank (data-parallel shares, expert-parallel ranks, sequence-parallel shares of each row)."""
    expected = torch_forwards[LAYOUTS[layout].family]["recording"].routed_experts
    outputs = load_file(str(runs[layout] / "outputs.safetensors"))
    recorded = [outputs[f"routes.{index}"] for index in range(len(seeded_batch()))]
    assert expected is not None and len(recorded) == len(expected)
    for index, (routes, reference) in enumerate(zip(recorded, expected, strict=True)):
        assert routes.dtype == reference.dtype and torch.equal(routes, reference), index


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_equal_the_torch_trainers(layout: str, runs: dict, torch_forwards: dict) -> None:
    expected = torch_forwards[LAYOUTS[layout].family]["own_routes"]
    saved = load_file(str(runs[layout] / "outputs.safetensors"))
    torch.testing.assert_close(saved["log_probs"], expected.log_probs, rtol=0, atol=2e-5)


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["single", "tp2-dp2-ep2"])
def test_replayed_rollout_routes_give_the_torch_trainers_replayed_log_probs(
    layout: str, runs: dict, torch_forwards: dict
) -> None:
    """R3 on the Megatron backend: every token that carries routes takes those experts (the rest route for
    themselves), as the torch trainer's replay does; under sequence parallelism each TP rank replays its share."""
    expected, own_routes = (torch_forwards["qwen3_moe"][name] for name in ("replayed", "own_routes"))
    saved = load_file(str(runs[layout] / "outputs.safetensors"))
    assert (expected.log_probs - own_routes.log_probs).abs().max() > 1e-2  # the replayed routes matter
    torch.testing.assert_close(saved["replayed"], expected.log_probs, rtol=0, atol=2e-5)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_checkpoint_with_whole_experts_resumes_with_split_experts_and_the_uninterrupted_step(runs: dict) -> None:
    """Experts, their Adam moments and the step count survive resharding from whole experts on each TP rank
    (expert TP 1) to experts split over the TP ranks (expert TP 2). The data layout stays (TP 2, DP 2), since the
    router losses are per micro-batch; and EP stays 2: megatron keeps the experts' optimizer apart from the dense
    one only under EP > 1, so its checkpoints do not move between EP 1 and EP > 1 (refused by name)."""
    out_dir = runs["tp2-dp2-ep2"]
    summary = json.loads((out_dir / "summary.json").read_text())
    resumed = json.loads((out_dir / "resumed.json").read_text())
    assert resumed["grad_norm"] == pytest.approx(summary["uninterrupted_grad_norm"], rel=1e-5)
    expected = load_file(str(out_dir / "uninterrupted.safetensors"))
    actual = load_file(str(out_dir / "resumed.safetensors"))
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
