"""Prompt datasets: errors that name file and line, deterministic epochs, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.data.prompts import Cursor, DatasetError, PromptSource, load_prompts


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.unit
def test_broken_lines_are_named_and_skipped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"input": "1+1=", "label": "2"}),
        "{not json",
        json.dumps({"question": "no input key"}),
        json.dumps({"input": "2+2=", "label": "4", "metadata": {"level": 1}}),
    ])
    records, report = load_prompts(path)
    assert [r.prompt for r in records] == ["1+1=", "2+2="]
    assert records[1].metadata == {"level": 1}
    assert len(report.skipped) == 2
    assert report.skipped[0].startswith(f"{path} line 2: not valid JSON")
    assert report.skipped[1] == f"{path} line 3: key 'input' missing (its keys: 'question')"


@pytest.mark.unit
def test_malformed_json_is_named_by_its_line_and_column(tmp_path: Path) -> None:
    """Columns count characters from 1 within the line; a line cut short fails at its end, not at column 1 of the
    line after (where json.loads of the raw line, line break included, puts it)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes("\ufeff".encode() + "\n".join([
        json.dumps({"input": "1+1=", "label": "2"}),
        '{"input": "2+2=", "label": "4"',
        '\t{"input": "caf\u00e9", oops}',
        '{"input": "3+3=", "label": "6",}',
        '{"input": "4+4=',
    ]).encode() + b"\r\n")
    records, report = load_prompts(path)
    assert [r.prompt for r in records] == ["1+1="], "a byte-order mark is not part of the first record"
    assert report.skipped == [
        f"{path} line 2: not valid JSON: Expecting ',' delimiter at the end of the line",
        f"{path} line 3: not valid JSON: Expecting property name enclosed in double quotes at column 20",
        f"{path} line 4: not valid JSON: Expecting property name enclosed in double quotes at column 32",
        f"{path} line 5: not valid JSON: Unterminated string starting at column 11",
    ]


@pytest.mark.unit
def test_broken_line_stops_the_load_when_asked(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input": "1+1=", "label": "2"}),
                                              json.dumps({"input": 3, "label": "3"})])
    with pytest.raises(DatasetError, match=r"p.jsonl line 2: key 'input': expected a non-empty string"):
        load_prompts(path, skip_bad=False)


@pytest.mark.unit
def test_parquet_prompts_load_like_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": ["a", "b"], "label": ["1", "2"]}), path)
    records, _ = load_prompts(path)
    assert [(r.prompt, r.label) for r in records] == [("a", "1"), ("b", "2")]


@pytest.mark.unit
def test_each_epoch_is_a_permutation_fixed_by_the_seed(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input": str(i)}) for i in range(20)])
    records, _ = load_prompts(path, label_key=None)
    first = PromptSource(records, seed=3)
    epoch0 = [first.next()[0].prompt for _ in range(20)]
    epoch1 = [first.next()[0].prompt for _ in range(20)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(20))
    assert epoch0 != epoch1
    again = PromptSource(records, seed=3)
    assert [again.next()[0].prompt for _ in range(20)] == epoch0


@pytest.mark.unit
def test_cursor_resumes_with_the_very_next_prompt(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input": str(i)}) for i in range(7)])
    records, _ = load_prompts(path, label_key=None)
    source = PromptSource(records, seed=1)
    for _ in range(10):
        _, cursor = source.next()
    expected = [source.next()[0].prompt for _ in range(6)]
    resumed = PromptSource(records, seed=1, cursor=Cursor(cursor.epoch, cursor.position))
    assert [resumed.next()[0].prompt for _ in range(6)] == expected


@pytest.mark.unit
def test_a_record_without_its_label_is_malformed_named_and_left_out(tmp_path: Path) -> None:
    rows = [{"input": f"{i}+1=", "label": str(i + 1)} for i in range(20)]
    rows[3] = {"input": "3+1=", "answer": "4"}
    rows[11] = {"input": "11+1=", "label": None}
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(row) for row in rows])
    records, report = load_prompts(path)
    assert [r.prompt for r in records] == [row["input"] for i, row in enumerate(rows) if i not in (3, 11)]
    assert all(r.label is not None for r in records)
    assert report.skipped == [f"{path} line 4: label key 'label' missing (its keys: 'input', 'answer')",
                              f"{path} line 12: label key 'label' null (its keys: 'input', 'label')"]
    assert report.skipped_summary() == (f"skipped 2 of 20 records of {path} as malformed, the first at line 4: "
                                        "label key 'label' missing (its keys: 'input', 'answer')")


@pytest.mark.unit
def test_a_label_key_that_no_record_has_says_which_keys_they_have(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input": "1+1=", "answer": "2"})] * 3)
    with pytest.raises(DatasetError) as raised:
        load_prompts(path, label_key="anwser")
    assert str(raised.value) == (
        f"{path}: no usable records (3 malformed, the first at line 1: label key 'anwser' missing (its keys: "
        "'input', 'answer')); name the label's key with --label-key (--eval-label-key for an eval set), or give "
        "--label-key none if the reward needs no label")


@pytest.mark.unit
def test_records_need_no_label_when_the_run_says_so(tmp_path: Path) -> None:
    from actors.config import RunConfig

    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"input": "judge this"})] * 2)
    config = RunConfig(prompt_data=str(path), label_key="none", eval_prompt_data=["held", str(path)],
                       eval_interval=1)
    assert config.data.label_key is None and config.eval_record_keys == ("input", None)
    records, report = load_prompts(path, label_key=config.data.label_key)
    assert [r.label for r in records] == [None, None] and report.skipped == []
    labelled_training = RunConfig(label_key="answer", eval_label_key="none")  # eval sets may carry no label alone
    assert labelled_training.eval_record_keys == ("input", None)
    assert RunConfig(label_key="answer").eval_record_keys == ("input", "answer")
