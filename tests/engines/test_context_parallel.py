"""Context parallelism on the torch trainer: a row split across ranks computes what the whole row computes.

The parity runs are real gloo worlds (ranks forked from one spawned leader that imported the trainer once:
tests/support/world_runs.py): CP=2, CP=2 x DP=2 and CP=3, each against one process on the whole batch, on log-probs
and entropy, the loss and its metrics, the gradient norm and every weight after a step;
dense and mixture-of-experts models, full and LoRA training; rows whose sequences do not divide into the 2C chunks
evenly, with shared prompts and a preamble packed once; calls after a prefix through the masked kernel and through
the prefix kernel. The split itself is proven without processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from engines.training import PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample, attention
from engines.training.attention import packed_segments
from engines.training.config import CriticSettings
from engines.training.context_parallel import ContextParallel, ContextRow, zigzag_rows
from engines.training.lora import LoraSettings
from engines.training.micro_batches import pack_inputs
from tests.support.training import step_loss
from tests.support.world_runs import WorldRuns
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

TEMPERATURE = 0.9


@dataclass(frozen=True)
class Case:
    """A trainer each parity world builds, one after another in the same processes. Those of a dense model trained
    whole carry PPO's critic too, which splits its rows as the policy does."""

    name: str
    family: str  # the tiny model's
    lora: bool = False
    recompute: bool = False  # activation checkpointing: the recomputed forward gathers its keys again
    router_losses: bool = False  # megatron's aux and z losses of the routers, over the whole row
    record_routes: bool = False  # pi_old's forward records each sample's routes (slime's --use-routing-replay)
    tiny_row: bool = False  # two 2-token samples: a row whose zigzag chunks leave one rank of three none of it
    # three samples of 80-100 tokens, a row each (micro-batches of 160 tokens): data-parallel replicas hold two rows
    # and one, the rows one process packs, so a loss of each micro-batch's own (the router losses) is comparable
    one_row_each: bool = False
    # every call of queries after a prefix through the prefix kernel, as a long row's are (short ones keep the
    # masked kernel), against one process's masked calls
    prefix_kernel: bool = False

    def batch(self) -> list[TrainSample]:
        if self.one_row_each:
            generator = torch.Generator().manual_seed(11)
            return [TrainSample(torch.randint(3, 100, (length,), generator=generator), length // 2,
                                loss_mask=torch.ones(length - length // 2),
                                advantages=torch.full((length - length // 2,), advantage))
                    for length, advantage in ((100, 1.0), (90, -0.5), (80, 0.25))]
        if self.tiny_row:
            return [TrainSample(torch.tensor(tokens), 1, loss_mask=torch.ones(1), advantages=torch.tensor([advantage]))
                    for tokens, advantage in (([7, 9], 1.0), ([11, 13], -0.5))]
        return long_rows_batch()

    @property
    def critic(self) -> bool:
        return self.family == "qwen2" and not self.lora


# (ranks, context-parallel size) -> what that world trains
CASES = {(2, 2): [Case("dense", "qwen2"), Case("dense-lora", "qwen2", lora=True),
                  Case("moe-router-losses", "qwen3_moe", router_losses=True, record_routes=True),
                  Case("moe-lora", "qwen3_moe", lora=True, prefix_kernel=True)],
         (4, 2): [Case("dense-recompute", "qwen2", recompute=True, prefix_kernel=True),
                  Case("moe-lora-dp", "qwen3_moe", lora=True),
                  Case("moe-router-losses-dp", "qwen3_moe", router_losses=True, one_row_each=True)],
         (3, 3): [Case("lora-tiny-row", "qwen2", lora=True, tiny_row=True)]}


@dataclass(frozen=True)
class ValueLoss:
    """Squared error of the values to the advantages (as returns) over the loss tokens of the whole step."""

    tokens: int

    def __call__(self, values: Tensor, batch: PackedBatch) -> tuple[Tensor, dict[str, float]]:
        assert batch.loss_mask is not None and batch.advantages is not None
        error = ((values - batch.advantages) ** 2 * batch.loss_mask).sum() / self.tokens
        return error, {"value_error": float(error.detach())}


def value_loss(batch: list[TrainSample]) -> ValueLoss:
    return ValueLoss(tokens=sum(int((s.loss_mask != 0).sum()) for s in batch))


def long_rows_batch() -> list[TrainSample]:
    """Rows of a few long samples: one alone (123 tokens), a group of three sharing a prompt, a pair sharing
    another, every prompt opening with one 12-token preamble (packed once per row), and a 5-token straggler;
    no sequence length divides by 4, so the zigzag chunks differ by a token."""
    generator = torch.Generator().manual_seed(5)

    def tokens(count: int) -> list[int]:
        return torch.randint(6, 100, (count,), generator=generator).tolist()

    preamble = tokens(12)
    shapes = [(tokens(61), [62]), (tokens(29), [33, 7, 18]), (tokens(17), [25, 3]), (tokens(2), [3])]
    batch = []
    for prompt, responses in shapes:
        for length in responses:
            ids = torch.tensor(preamble + prompt + tokens(length))
            mask = (torch.rand(length, generator=generator) > 0.2).float()
            batch.append(TrainSample(ids, length, loss_mask=mask, advantages=torch.randn(length, generator=generator)))
    return batch


def data_parallel_shard(batch: list[TrainSample], rank: int, size: int) -> list[TrainSample]:
    """Whole groups per data-parallel rank (the long sample and the pair on one, the group of three and the
    straggler on the other); of three rows, two on the first and one on the second."""
    if size == 1:
        return batch
    return [batch[i] for i in (((0, 1), (2,)) if len(batch) == 3 else ((0, 4, 5), (1, 2, 3, 6)))[rank]]


def trainer_config(case: Case, models: dict[str, str], context: int) -> TorchTrainerConfig:
    path = Path(models[case.family])
    return TorchTrainerConfig(model_path=path, lr=1e-2, eps=1.0, grad_clip=None, micro_batch_tokens=160,
                              check_packing=False, lora=LoraSettings(rank=4, alpha=8.0) if case.lora else None,
                              gradient_checkpointing=case.recompute, context_parallel_size=context,
                              critic=CriticSettings(model_path=path, lr=1e-2) if case.critic else None,
                              moe_aux_loss_coeff=0.1 if case.router_losses else 0.0,
                              moe_z_loss_coeff=0.01 if case.router_losses else 0.0,
                              use_routing_replay=case.record_routes)


def critic_step(trainer: TorchTrainer, shard: list[TrainSample]) -> tuple[dict[str, Tensor], dict]:
    """The critic's values of `shard`, one critic step, and its values after it (which its new weights decide)."""
    before = trainer.compute_values(shard)
    result = trainer.train_critic(shard, value_loss(long_rows_batch()))
    after = trainer.compute_values(shard)
    return {"values": before, "values_after": after}, {"grad_norm": result.grad_norm, "metrics": result.metrics}


def _parity_worker(rank: int, out_dir: Path, world: int, context: int, models: dict[str, str]) -> None:
    """One rank of a world (`WorldRuns` joined it to the world's gloo group): every case of the world in turn."""
    masked_below = attention.PREFIX_KERNEL_ELEMENTS
    for case in CASES[world, context]:
        name = case.name
        attention.PREFIX_KERNEL_ELEMENTS = 1 if case.prefix_kernel else masked_below
        trainer = TorchTrainer(trainer_config(case, models, context=context))
        parallel = trainer.data_parallel()
        assert (parallel.size, parallel.rank) == (world // context, rank // context)
        shard = data_parallel_shard(case.batch(), parallel.rank, parallel.size)
        outputs = trainer.compute_log_probs(shard, temperature=TEMPERATURE, with_entropy=True)
        result = trainer.train_step(shard, step_loss(case.batch()), temperature=TEMPERATURE, with_entropy=True)
        tensors = {"log_probs": outputs.log_probs, "entropy": outputs.entropy}
        if case.record_routes:
            tensors["routes"] = torch.cat(outputs.routed_experts)
        critic: dict = {}
        if trainer.has_critic:
            values, critic = critic_step(trainer, shard)
            tensors.update(values)
        save_file(tensors, str(out_dir / f"{name}-outputs-{rank}.st"))
        if rank == 0:
            save_file({key: tensor.contiguous() for key, tensor in trainer.named_tensors()},
                      str(out_dir / f"{name}-weights.st"))
            summary = {"version": result.version, "grad_norm": result.grad_norm, "metrics": result.metrics,
                       "critic": critic}
            (out_dir / f"{name}-result.json").write_text(json.dumps(summary))
        trainer.close()
        dist.barrier()


@pytest.fixture(scope="module")
def models(tiny_model_cache: Path) -> dict[str, str]:
    return {family: str(cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family)))
            for family in ("qwen2", "qwen3_moe")}


def world_name(world: int, context: int) -> str:
    return f"{world}x{context}"


# What a rank imports to build a torch trainer, imported once in the leader that forks every world's ranks.
TRAINER_MODULES = ("engines.training", "torch.distributed", "safetensors.torch")


@pytest.fixture(scope="module")
def worlds(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> WorldRuns:
    """Each world's outputs (asking for one runs all three, forked from one leader, one world after another)."""
    return WorldRuns(tmp_path_factory, {world_name(*key): key[0] for key in CASES}, _parity_worker,
                     lambda name: (*next(key for key in CASES if world_name(*key) == name), models),
                     preload=TRAINER_MODULES)


@pytest.mark.integration
@pytest.mark.parametrize(("world", "context"), sorted(CASES), ids=lambda n: str(n))
def test_a_row_split_across_a_context_parallel_group_trains_as_the_whole_row(
        world: int, context: int, models: dict[str, str], worlds: WorldRuns) -> None:
    out_dir = worlds[world_name(world, context)]
    replicas = world // context
    for case in CASES[world, context]:
        name = case.name
        batch = case.batch()
        shards = [data_parallel_shard(batch, replica, replicas) for replica in range(replicas)]
        single = TorchTrainer(trainer_config(case, models, context=1))
        # what one process computes on each data-parallel shard, held by all the context ranks of its replica
        expected = [single.compute_log_probs(shard, temperature=TEMPERATURE, with_entropy=True) for shard in shards]
        for rank in range(world):
            whole = expected[rank // context]
            split = load_file(str(out_dir / f"{name}-outputs-{rank}.st"))
            torch.testing.assert_close(split["log_probs"], whole.log_probs, atol=2e-5, rtol=1e-5,
                                       msg=f"{name} rank {rank}")
            torch.testing.assert_close(split["entropy"], whole.entropy, atol=2e-5, rtol=1e-5)
            if case.record_routes:  # every token's experts, recorded where its row was and joined per sample
                assert torch.equal(split["routes"], torch.cat(whole.routed_experts)), f"{name} rank {rank}"
        result = single.train_step(batch, step_loss(batch), temperature=TEMPERATURE, with_entropy=True)
        parallel = json.loads((out_dir / f"{name}-result.json").read_text())
        if single.has_critic:  # the critic's step on the whole batch, its values before and after it per shard
            before = [single.compute_values(shard) for shard in shards]
            critic = single.train_critic(batch, value_loss(batch))
            assert parallel["critic"]["grad_norm"] == pytest.approx(critic.grad_norm, rel=1e-4)
            assert parallel["critic"]["metrics"]["value_error"] == pytest.approx(critic.metrics["value_error"],
                                                                                rel=1e-5)
            after = [single.compute_values(shard) for shard in shards]
            for rank in range(world):
                split = load_file(str(out_dir / f"{name}-outputs-{rank}.st"))
                torch.testing.assert_close(split["values"], before[rank // context], atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(split["values_after"], after[rank // context], atol=2e-5, rtol=1e-5)
        assert parallel["version"] == result.version == 1
        assert parallel["metrics"]["sequences"] == len(batch)
        assert parallel["metrics"]["loss_tokens"] == result.metrics["loss_tokens"]
        assert parallel["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-4)
        assert parallel["metrics"]["loss"] == pytest.approx(result.metrics["loss"], rel=1e-5)
        assert parallel["metrics"]["token_term"] == pytest.approx(result.metrics["token_term"], rel=1e-5)
        for metric in ("moe/load_balancing_loss", "moe/z_loss") if case.router_losses else ():
            assert parallel["metrics"][metric] == pytest.approx(result.metrics[metric], rel=1e-5), metric
        weights = load_file(str(out_dir / f"{name}-weights.st"))
        for key, tensor in single.named_tensors():
            torch.testing.assert_close(weights[key], tensor, atol=1e-6, rtol=1e-5, msg=f"{name}: {key}")
        single.close()


@pytest.mark.unit
@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_zigzag_split_gives_every_row_to_one_rank_and_each_rank_the_same_causal_work(size: int) -> None:
    inputs = pack_inputs(long_rows_batch(), share_prompts=True)
    length = inputs.input_ids.shape[-1]
    segments = packed_segments(inputs.position_ids, length, inputs.row_starts)
    held = zigzag_rows(segments, size)
    assert sorted(row for rows in held for row in rows) == list(range(length))
    # causal work of a query: the keys it reads (its segment's context, then its own rows up to itself)
    work = torch.zeros(length)
    for segment in segments:
        context = sum(end - begin for begin, end in segment.context)
        work[segment.start:segment.end] = context + torch.arange(1, segment.end - segment.start + 1)
    per_rank = [float(work[rows].sum()) for rows in held]
    # each rank within a few rows' work of the mean (one row more or less per chunk of each segment)
    assert max(per_rank) - min(per_rank) <= 2 * len(segments) * float(work.max())
    assert max(per_rank) / min(per_rank) < 1.1
    # chunks that leave a rank none of a row: it takes a row from the rank holding most (`lora-tiny-row`)
    two_pairs = packed_segments(torch.tensor([[0, 1, 0, 1]]), 4)
    assert zigzag_rows(two_pairs, 3) == [[1], [3], [0, 2]]
    with pytest.raises(ValueError, match=r"a packed row of 2 tokens cannot be split across 3 ranks"):
        zigzag_rows(packed_segments(None, 2), 3)


@pytest.mark.unit
def test_each_rank_computes_the_response_tokens_its_rows_predict_and_attends_to_every_key_before_them() -> None:
    inputs = pack_inputs(long_rows_batch(), share_prompts=True)
    length = inputs.input_ids.shape[-1]
    segments = packed_segments(inputs.position_ids, length, inputs.row_starts)
    predicted: list[int] = []
    for rank in range(2):
        row = ContextRow(ContextParallel(rank, 2, group=None, reduce_scatter=False), segments, length,
                         inputs.logit_positions, torch.device("cpu"))
        predicted += row.tokens.tolist()
        # the local rows predicting our tokens are those the whole row predicts them from
        assert torch.equal(row.rows[row.logit_rows], inputs.logit_positions[row.tokens])
        covered = torch.zeros(row.length, dtype=torch.int64)
        for call in row.calls:
            covered[call.queries] += 1
            queries = row.rows[call.queries]
            # the keys end at the run's last query, so the bottom-right causal mask is each query's own prefix
            assert int(call.keys[-1]) == int(queries[-1])
            segment = next(s for s in segments if s.start <= int(queries[0]) < s.end)
            context = [r for begin, end in segment.context for r in range(begin, end)]
            assert call.keys.tolist() == context + list(range(segment.start, int(queries[-1]) + 1))
        assert torch.equal(covered, torch.ones(row.length, dtype=torch.int64))
    assert sorted(predicted) == list(range(inputs.targets.numel()))


@pytest.mark.unit
def test_a_split_row_needs_the_attention_that_gathers_its_keys(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"context_parallel_size 2: not available with attn_implementation 'sdpa'"):
        TorchTrainerConfig(model_path=tiny_model_path, context_parallel_size=2, attn_implementation="sdpa")

