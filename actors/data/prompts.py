"""Prompt datasets: JSONL or Parquet records, a deterministic order per epoch, and a cursor that resumes exactly.

The order of epoch e is a permutation seeded by (seed, e), so the cursor (epoch, position) is all the state
a resumed run needs to continue with the very next prompt. Malformed lines are reported with file, line and (for
JSON) column, and either skipped (counted, the run goes on) or raised, by `--skip-bad-data`. Prompts over a token cap
(`--rollout-max-prompt-len`, `--eval-max-prompt-len`) are dropped at load and counted apart from bad lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from actors.config.errors import ConfigError
from actors.data.prompt_images import ImageField, PromptImageError, prompt_with_images, record_images

if TYPE_CHECKING:
    from actors.config.sections import DataConfig


class DatasetError(ConfigError):
    """A dataset that cannot be used: the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class PromptRecord:
    data_index: int  # position in the file's valid records, stable across epochs
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    tools: list[dict[str, Any]] | None = None  # the row's tool definitions (--tool-key), for the chat template
    images: list[bytes] = field(default_factory=list)  # the row's images, encoded (--multimodal-keys)


@dataclass
class LoadReport:
    path: str
    records: int = 0
    skipped: list[str] = field(default_factory=list)  # "line N: reason"
    too_long: int = 0  # valid records dropped for exceeding the prompt token cap
    first_too_long: str = ""  # "line N (T tokens)": where to look, as a malformed record's line says

    def skipped_summary(self) -> str:
        """One line for the console: how many records were left out and the first reason (every reason is logged
        apart); a file with a few bad rows among thousands should not print thousands of warnings."""
        total = self.records + len(self.skipped) + self.too_long
        return (f"skipped {len(self.skipped)} of {total} records of {self.path} as malformed, the first at "
                f"{self.skipped[0].removeprefix(f'{self.path} ')}")


def _raw_rows(path: Path, max_rows: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line or row number, the parsed record or the DatasetError that says why it is not one); with `max_rows`,
    only the file's first rows are read."""
    if path.suffix == ".parquet":
        yield from enumerate(_parquet_rows(path, max_rows), start=1)
        return
    with path.open(encoding="utf-8-sig") as handle:  # -sig: a byte-order mark is not part of line 1's JSON
        read = 0
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if max_rows is not None and read >= max_rows:
                return
            read += 1
            yield number, _parse_line(line)


def _parquet_rows(path: Path, max_rows: int | None) -> list[Any]:
    import pyarrow.parquet as pq

    if max_rows is None:
        return pq.read_table(path).to_pylist()
    rows: list[Any] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=max_rows):  # a batch ends at its row group's end
        rows += batch.to_pylist()
        if len(rows) >= max_rows:
            break
    return rows[:max_rows]


def _parse_line(line: str) -> Any:
    """The line's JSON value, or a DatasetError naming the column (1-based, in characters) where parsing failed."""
    text = line.rstrip("\r\n")  # the line break is no part of the record: an error there is at the line's end
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = "the end of the line" if error.pos >= len(text) else f"column {error.colno}"
        return DatasetError(f"not valid JSON: {error.msg.removesuffix(' at')} at {where}")


def load_prompts(path: str | Path, *, input_key: str = "input", label_key: str | None = "label",
                 metadata_key: str | None = "metadata", tool_key: str | None = None, chat_template: bool = False,
                 skip_bad: bool = True, max_prompt_len: int | None = None,
                 count_tokens: Callable[[Any, Any, list[bytes]], int] | None = None,
                 max_rows: int | None = None,
                 image_field: ImageField | None = None) -> tuple[list[PromptRecord], LoadReport]:
    """Read every usable record; with skip_bad=False the first bad one raises DatasetError.

    A record's `tool_key` entry (optional per record; a list of tool definitions, or that list as a JSON string as
    Parquet files often hold it) goes to the chat template with its prompt; `chat_template` says whether a plain-text
    prompt goes through the template at all (one that does not cannot carry tools). With `image_field`
    (--multimodal-keys), a record's images are read and checked and its prompt becomes messages with one image part
    per image (`actors.data.prompt_images`); a record whose images cannot be used is malformed.

    With `max_prompt_len`, records whose prompt `count_tokens` finds longer are left out (counted in
    `report.too_long`), as slime filters long prompts when it loads a dataset. With `max_rows`, only the file's
    first rows are read: the launcher's preflight checks a dataset that way, in bounded time."""
    if max_prompt_len is not None and count_tokens is None:
        raise ValueError("max_prompt_len needs count_tokens (the tokenizer's prompt length)")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise DatasetError(f"{path}: unsupported format {path.suffix!r}; use .jsonl or .parquet")
    report = LoadReport(path=str(path))
    records: list[PromptRecord] = []
    unit = "row" if path.suffix == ".parquet" else "line"
    for number, row in _raw_rows(path, max_rows):
        problem = _check_row(row, input_key, label_key, metadata_key)
        tools: list[dict[str, Any]] | None = None
        if problem is None and tool_key is not None:
            tools, problem = _row_tools(row, tool_key, row[input_key], chat_template)
        prompt = row[input_key] if problem is None else None
        images: list[bytes] = []
        if problem is None and image_field is not None:
            prompt, images, problem = _prompt_and_images(row, input_key, image_field, path.parent)
        length = 0
        if problem is None and max_prompt_len is not None and count_tokens is not None:
            try:
                length = count_tokens(prompt, tools, images)
            except PromptImageError as error:  # images the model cannot take (a text-only model)
                problem = str(error)
        if problem is not None:
            message = f"{path} {unit} {number}: {problem}"
            if not skip_bad:
                raise DatasetError(message)
            report.skipped.append(message)
            continue
        if max_prompt_len is not None and length > max_prompt_len:
            report.first_too_long = report.first_too_long or f"{unit} {number} ({length} tokens)"
            report.too_long += 1
            continue
        metadata = row.get(metadata_key) if metadata_key else None
        records.append(PromptRecord(
            data_index=len(records), prompt=prompt,
            label=row[label_key] if label_key else None, metadata=dict(metadata or {}), tools=tools, images=images,
        ))
    report.records = len(records)
    if not records:
        raise DatasetError(f"{path}: {_why_no_records(report, unit, max_prompt_len, max_rows)}")
    return records, report


def _why_no_records(report: LoadReport, unit: str, max_prompt_len: int | None, max_rows: int | None) -> str:
    if not report.skipped and not report.too_long:
        return "no records (the file is empty)"
    reasons = []
    if report.skipped:
        first = report.skipped[0].removeprefix(f"{report.path} ")
        reasons.append(f"{len(report.skipped)} malformed, the first at {first}")
    if report.too_long:
        reasons.append(f"{report.too_long} over {max_prompt_len} prompt tokens, the first at {report.first_too_long}")
    scope = f" in its first {max_rows} {unit}s" if max_rows is not None else ""
    hint = ""
    if report.skipped and all(f": {LABEL_PROBLEM} " in problem for problem in report.skipped):
        hint = ("; name the label's key with --label-key (--eval-label-key for an eval set), or give "
                "--label-key none if the reward needs no label")
    return f"no usable records{scope} ({'; '.join(reasons)}){hint}"


SHOWN_KEYS = 8  # of a record without the prompt's or the label's key
LABEL_PROBLEM = "label key"


def _keys_of(row: dict[str, Any]) -> str:
    keys = ", ".join(repr(key) for key in list(row)[:SHOWN_KEYS]) + (", ..." if len(row) > SHOWN_KEYS else "")
    return keys or "none"


def _check_row(row: Any, input_key: str, label_key: str | None, metadata_key: str | None) -> str | None:
    if isinstance(row, DatasetError):
        return str(row)
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if input_key not in row:  # its own keys show which one to name (--input-key)
        return f"key {input_key!r} missing (its keys: {_keys_of(row)})"
    # A label that is not there would be scored as a wrong answer, every time, and trained on as such.
    if label_key is not None and row.get(label_key) is None:
        found = "missing" if label_key not in row else "null"
        return f"{LABEL_PROBLEM} {label_key!r} {found} (its keys: {_keys_of(row)})"
    prompt = row[input_key]
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            return f"key {input_key!r}: chat messages need 'role' and 'content'"
    elif not isinstance(prompt, str) or not prompt:
        return f"key {input_key!r}: expected a non-empty string or a list of chat messages"
    if metadata_key and row.get(metadata_key) is not None and not isinstance(row[metadata_key], dict):
        return f"key {metadata_key!r}: expected an object"
    return None


def _prompt_and_images(row: dict[str, Any], input_key: str, image_field: ImageField,
                       folder: Path) -> tuple[Any, list[bytes], str | None]:
    """The record's prompt as messages with its image parts, its images, or what is wrong with them."""
    try:
        images = record_images(row, image_field, folder)
        return prompt_with_images(row[input_key], len(images), input_key=input_key, image_key=image_field.key), \
            images, None
    except PromptImageError as error:
        return None, [], str(error)


def _row_tools(row: dict[str, Any], tool_key: str, prompt: Any,
               chat_template: bool) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The record's tool definitions (None: it has none) or what is wrong with them."""
    tools = row.get(tool_key)
    if tools is None:
        return None, None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            return None, f"key {tool_key!r}: a string that is not JSON ({error.msg})"
    if hasattr(tools, "tolist"):  # a Parquet list column read as an array
        tools = tools.tolist()
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        return None, f"key {tool_key!r}: expected a list of tool definitions (objects), got {type(tools).__name__}"
    if tools and not chat_template and not isinstance(prompt, list):
        return None, (f"key {tool_key!r}: tools reach the model through the chat template, and this prompt is plain "
                      "text with --apply-chat-template off")
    return tools or None, None


def image_field(data: DataConfig) -> ImageField | None:
    """Where the run's records hold their images (--multimodal-keys), with its image limits; None: text records."""
    return None if data.image_key is None else ImageField(data.image_key, data.image_limits)


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    position: int = 0


class PromptStreamError(ConfigError):
    """A prompt stream's answer that cannot be used (a user's source returned a malformed group, or raised): the
    message names the plugin and what is wrong, and the run fails with it."""


class PromptStream(Protocol):
    """Where the buffer's new prompt groups come from, in order: our dataset (`PromptSource`), a run without one
    (`EmptyPrompts`), or a user's source (slime's --data-source-path, adapted in actors/slime_compat). The buffer
    gives each prompt its group id and exactly-once accounting, and logs the cursor with every lease; a restarted
    buffer seeks the stream back to the logged cursor, handing it what `save` returned at the last learner
    checkpoint before that."""

    cursor: Cursor

    def next(self) -> tuple[PromptRecord, Cursor] | None:
        """The next prompt and the cursor just past it; None: the stream has nothing now (asked again later)."""

    def save(self, rollout_id: int) -> dict[str, Any] | None:
        """At a learner checkpoint: keep the stream's own state, returning what `seek` needs to find it (None: the
        cursor is all the state there is)."""

    def seek(self, cursor: Cursor, saved: dict[str, Any] | None) -> None:
        """Continue from `cursor` (a resumed buffer), from the state `save` last returned (None: never saved)."""


class PromptSource:
    """Endless, deterministic, resumable stream of prompts over epochs."""

    def __init__(self, records: list[PromptRecord], *, seed: int, cursor: Cursor = Cursor(), shuffle: bool = True):
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor
        self._order = self._permutation(cursor.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next(self) -> tuple[PromptRecord, Cursor]:
        """The next prompt and the cursor that points just past it."""
        if self.cursor.position >= len(self.records):
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
            self._order = self._permutation(self.cursor.epoch)
        record = self.records[int(self._order[self.cursor.position])]
        self.cursor = Cursor(self.cursor.epoch, self.cursor.position + 1)
        return record, self.cursor

    def save(self, rollout_id: int) -> None:
        """The cursor is the whole state (the order of an epoch is a function of the seed)."""

    def seek(self, cursor: Cursor, saved: dict[str, Any] | None = None) -> None:
        self.cursor = cursor
        self._order = self._permutation(cursor.epoch)


class EmptyPrompts:
    """slime's --disable-rollout-global-dataset: no dataset; every group has an empty prompt, which the user's
    generate or rollout function replaces with prompts of its own (an environment's, a generator's). Endless; the
    cursor counts the groups."""

    def __init__(self) -> None:
        self.cursor = Cursor()

    def next(self) -> tuple[PromptRecord, Cursor]:
        record = PromptRecord(data_index=self.cursor.position, prompt="", label=None, metadata={})
        self.cursor = Cursor(0, self.cursor.position + 1)
        return record, self.cursor

    def save(self, rollout_id: int) -> None:
        """Nothing but the count."""

    def seek(self, cursor: Cursor, saved: dict[str, Any] | None = None) -> None:
        self.cursor = cursor
