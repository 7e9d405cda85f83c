"""Several adapters served unmerged at once: each row of a batch computes what its adapter merged would compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from engines.inference.multi_lora import MultiLora
from tests.support.adapters import merge_into, random_adapter

pytestmark = pytest.mark.unit


def _model(path: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _merged(path: Path, adapter: list[tuple[str, Tensor]], scaling: float) -> nn.Module:
    return merge_into(_model(path), adapter, scaling)


def _logits(model: nn.Module, rows: Tensor) -> Tensor:
    with torch.no_grad():
        return model(input_ids=rows).logits


ROWS = torch.tensor([[5, 17, 33, 8, 21, 40], [9, 9, 12, 60, 3, 27], [44, 2, 18, 7, 30, 11], [6, 50, 25, 14, 1, 36]])


def test_a_batch_mixing_adapters_gives_each_row_its_own_adapters_logits(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    adapters = {"a": (random_adapter(model, 4, 1), 2.0), "b": (random_adapter(model, 8, 2), 0.5)}
    served = MultiLora(model)
    for name, (tensors, scaling) in adapters.items():
        served.load(name, tensors, scaling)
    names = ["a", None, "b", "a"]
    with served.adapter_rows(names, "cpu"):
        mixed = _logits(model, ROWS)
    base = _logits(_model(tiny_model_path), ROWS)
    for row, name in enumerate(names):
        alone = base if name is None else _logits(_merged(tiny_model_path, *adapters[name]), ROWS[row:row + 1])
        expected = alone[row] if name is None else alone[0]
        torch.testing.assert_close(mixed[row], expected, atol=1e-5, rtol=1e-5, msg=f"row {row} ({name})")
    assert torch.equal(mixed[1], base[1])  # a base row adds exact zeros
    assert not torch.allclose(mixed[0], base[0], atol=1e-3)  # the adapters do change the logits
    assert torch.equal(_logits(model, ROWS), base)  # outside adapter_rows the model is the base model


def test_replacing_one_adapter_leaves_the_others_outputs_bit_identical(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    served = MultiLora(model)
    served.load("a", random_adapter(model, 4, 1), 2.0)
    served.load("b", random_adapter(model, 4, 2), 2.0)
    names = ["a", "b", "b", "a"]
    with served.adapter_rows(names, "cpu"):
        before = _logits(model, ROWS)
        served.load("a", random_adapter(model, 4, 3), 2.0)
        after = _logits(model, ROWS)
    assert torch.equal(after[1:3], before[1:3])
    assert not torch.allclose(after[0], before[0], atol=1e-3)
    fresh = _merged(tiny_model_path, random_adapter(model, 4, 3), 2.0)
    torch.testing.assert_close(after[0], _logits(fresh, ROWS[:1])[0], atol=1e-5, rtol=1e-5)


def test_a_removed_adapter_is_refused_and_its_layers_serve_the_base(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    served = MultiLora(model)
    served.load("a", random_adapter(model, 4, 1), 2.0)
    served.load("b", random_adapter(model, 4, 2), 2.0)
    with served.adapter_rows(["b"], "cpu"):
        only_b = _logits(model, ROWS[:1])
    served.remove("a")
    assert served.names == ("b",)
    with pytest.raises(KeyError, match="adapter 'a' is not loaded"):
        served.slots(["a"], "cpu")
    with served.adapter_rows(["b"], "cpu"):
        assert torch.equal(_logits(model, ROWS[:1]), only_b)
    served.remove("b")
    assert torch.equal(_logits(model, ROWS), _logits(_model(tiny_model_path), ROWS))


def test_bad_loads_name_the_adapter_and_the_tensor_and_change_nothing(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    served = MultiLora(model, max_adapters=1)
    good = random_adapter(model, 4, 1)
    served.load("a", good, 2.0)
    with served.adapter_rows(["a"], "cpu"):
        before = _logits(model, ROWS[:1])
    q_a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ([(q_a, torch.zeros(4, 7))], "adapter 'a': 'model.layers.0.self_attn.q_proj.lora_A.weight' has shape "
                                    r"\(4, 7\); the layer takes 64 inputs"),
        ([("model.layers.0.self_attn.nope.lora_A.weight", torch.zeros(4, 64))],
         "adapter 'a': 'model.layers.0.self_attn.nope.lora_A.weight': the model has no linear layer"),
        ([(q_a, torch.zeros(2, 64))],
         "adapter 'a': model.layers.0.self_attn.q_proj: lora_A has rank 2, lora_B rank 4"),
        ([*random_adapter(model, 4, 9)[:-2], (q_a, torch.ones(4, 64))], "appears twice"),
    ]
    for tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            served.load("a", tensors, 2.0)
    with served.adapter_rows(["a"], "cpu"):
        assert torch.equal(_logits(model, ROWS[:1]), before)
    with pytest.raises(ValueError, match="adapter 'b': 1 adapters are loaded already"):
        served.load("b", good, 2.0)
    served.remove("a")
    with pytest.raises(ValueError, match=r"adapter 'b': model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight arrived "
                                         r"without model\.layers\.0\.self_attn\.q_proj\.lora_B\.weight"):
        served.load("b", [(q_a, torch.zeros(4, 64))], 2.0)
    assert served.names == ()


def test_a_load_keeps_its_own_copy_of_factors_handed_over_as_reused_buffers(tiny_model_path: Path) -> None:
    """A receiver hands over views of buffers it refills with the next bucket: A in one bucket, B in the next. The
    slot must hold the A that arrived, not what the buffer held when B came."""
    model = _model(tiny_model_path)
    (a_name, a_factor), (b_name, b_factor) = random_adapter(model, 4, 1)[:2]
    buffer = a_factor.clone()
    served = MultiLora(model)
    served.load("a", [(a_name, buffer), (b_name, b_factor)], 2.0)
    buffer.fill_(7.0)  # the receiver reuses its buffer for the next bucket
    served.load("a", [(b_name, b_factor * 3)], 2.0)  # the next bucket: B alone rewrites the slot from the kept A

    held = served.served("a", [a_name, b_name])
    assert torch.equal(held[a_name], a_factor) and torch.equal(held[b_name], b_factor * 3)


def test_what_an_adapter_serves_is_what_its_slot_holds(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    factors = random_adapter(model, 4, 1)
    served = MultiLora(model)
    served.load("a", factors, 2.0)
    served.load("b", random_adapter(model, 4, 2), 2.0)
    names = [name for name, _ in factors]

    assert served.served("a", names).keys() == set(names)
    assert served.served("missing", names) == {}
    layer = served._layers[names[0].removesuffix(".lora_A.weight")]
    with torch.no_grad():
        layer.lora_b[served._adapters["a"].slot, 0, 0] += 1.0  # the slot no longer holds what was loaded
    assert names[0] not in served.served("a", names) and names[1] not in served.served("a", names)
    assert served.served("b", [name for name, _ in random_adapter(model, 4, 2)])  # the other adapter's slot holds
