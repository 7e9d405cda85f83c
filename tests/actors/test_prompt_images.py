"""Images in the prompt data (`--multimodal-keys`, slime's flag): each record's images read from a file path, base64,
a data: URL or Parquet bytes, checked at load, and carried by its group to the rollout workers byte for byte; a
record with a missing, broken or too large image is named (file, line, key, image), skipped and counted."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from PIL import Image

from actors.buffer.core import BufferCore
from actors.config import build_config
from actors.config.settings_errors import SettingsError
from actors.data.prompts import DatasetError, PromptSource, image_field, load_prompts
from bus.codec import decode, encode
from engines.vision.images import encode_png
from tests.actors.test_slime_flags import configure

IMAGE_PART = {"type": "image"}


def png(width: int, height: int, colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    return encode_png(Image.new("RGB", (width, height), colour))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.unit
def test_images_from_paths_base64_and_data_urls_reach_the_group_byte_for_byte_and_bad_ones_are_named(
        tmp_path: Path) -> None:
    red, green, blue, wide = png(8, 8, (255, 0, 0)), png(9, 7), png(6, 6, (0, 0, 255)), png(64, 64)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(red)
    (tmp_path / "green.png").write_bytes(green)
    (tmp_path / "broken.png").write_bytes(red[: len(red) // 2])
    (tmp_path / "wide.png").write_bytes(wide)
    rows = [
        {"input": "<image>How many?", "label": "1", "images": ["pics/red.png"]},  # relative to the data file
        {"input": "Compare <image> and <image>.", "label": "2",
         "images": [str(tmp_path / "green.png"), base64.b64encode(blue).decode()]},  # absolute path, base64
        {"input": [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": "?"}]}],
         "label": "3", "images": "data:image/png;base64," + base64.b64encode(red).decode()},  # one, as a data URL
        {"input": "<image>?", "label": "4", "images": ["pics/missing.png"]},
        {"input": "<image>?", "label": "5", "images": ["broken.png"]},
        {"input": "<image>?", "label": "6", "images": ["wide.png"]},  # over --max-image-pixels
        {"input": "<image>?", "label": "7", "images": ["https://example.com/cat.png"]},
        {"input": "<image>?", "label": "8", "images": ["pics/red.png", "green.png"]},  # one mark, two images
        {"input": "no picture here", "label": "9"},  # a text record among image records
    ]
    path = write_rows(tmp_path / "prompts.jsonl", rows)
    config = build_config({"prompt_data": str(path), "multimodal_keys": '{"image": "images"}',
                           "max_image_pixels": 32 * 32})
    records, report = load_prompts(path, image_field=image_field(config.data))

    assert [record.images for record in records] == [[red], [green, blue], [red], []]
    assert records[0].prompt == [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "How many?"}]}]
    assert records[1].prompt[0]["content"] == [{"type": "text", "text": "Compare "}, IMAGE_PART,
                                               {"type": "text", "text": " and "}, IMAGE_PART,
                                               {"type": "text", "text": "."}]
    assert records[2].prompt[0]["content"][0] == IMAGE_PART  # the part is bare: its bytes travel beside it
    assert records[3].prompt == [{"role": "user", "content": "no picture here"}]  # slime's: messages, text as text
    assert len(report.skipped) == 5 and report.records == 4
    problems = [problem.removeprefix(f"{path} ") for problem in report.skipped]
    assert problems[0] == f"line 4: key 'images' image 0: no image file {tmp_path}/pics/missing.png (and the value " \
                          "is not base64)"
    assert problems[1].startswith(f"line 5: key 'images' image 0 (file {tmp_path}/broken.png): not a readable image")
    assert problems[2] == (f"line 6: key 'images' image 0 (file {tmp_path}/wide.png): the image is 64x64 = 4096 "
                           "pixels, over the limit of 1024")
    assert problems[3].startswith("line 7: key 'images' image 0: 'https://example.com/cat.png' is a URL; images are "
                                  "not fetched from the network")
    assert problems[4].startswith("line 8: key 'input' has 1 image item(s) ('<image>' in text or {'type': 'image'} "
                                  "parts) for 2 image(s) in key 'images'")
    assert all(problem.startswith(str(path)) for problem in report.skipped)  # the data file, then the line

    core = BufferCore(source=PromptSource(records, seed=1, shuffle=False), n_samples=2, groups_per_batch=4,
                      max_staleness=0, lease_timeout=10.0)
    leased = core.lease("rollout-0-0", max_groups=4)
    assert leased is not None
    groups = [decode(encode(group)) for group in leased[1]]  # as the rollout worker receives them
    assert [group.images for group in groups] == [[red], [green, blue], [red], []]
    assert groups[1].prompt == records[1].prompt


@pytest.mark.unit
def test_an_oversized_image_is_refused_before_it_is_decoded_and_strict_loading_stops_at_it(tmp_path: Path) -> None:
    big = png(40, 40)
    (tmp_path / "big.png").write_bytes(big)
    encoded = base64.b64encode(big).decode()
    path = write_rows(tmp_path / "p.jsonl", [{"input": "<image>", "label": "1", "images": "big.png"},
                                             {"input": "<image>", "label": "1", "images": encoded},
                                             {"input": "plain text", "label": "1"}])
    config = build_config({"multimodal_keys": {"image": "images"}, "max_image_bytes": 64, "skip_bad_data": False})
    with pytest.raises(DatasetError, match=f"p.jsonl line 1: key 'images' image 0 \\(file {tmp_path}/big.png\\): "
                                           f"the image is {len(big)} bytes, over the limit of 64"):
        load_prompts(path, image_field=image_field(config.data), skip_bad=config.data.skip_bad_data)
    records, report = load_prompts(path, image_field=image_field(config.data))
    assert [record.images for record in records] == [[]]
    assert report.skipped[1] == (f"{path} line 2: key 'images' image 0: the base64 image is about "
                                 f"{len(encoded) * 3 // 4} bytes, over the limit of 64")


@pytest.mark.unit
def test_parquet_binary_and_hugging_face_image_columns_are_read(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, green = png(5, 5, (255, 0, 0)), png(7, 3)
    table = pa.table({
        "input": ["<image><image>two?", "<image>one?", "<image>bad?"],
        "label": ["2", "1", "0"],
        "images": pa.array([[red, green], [green], [b"\x89PNG not really"]], type=pa.list_(pa.binary())),
        "picture": [{"bytes": red, "path": None}, {"bytes": None, "path": "gone.png"}, {"bytes": green, "path": None}],
    })
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    config = build_config({"multimodal_keys": '{"image": "images"}'})
    records, report = load_prompts(path, image_field=image_field(config.data))
    assert [record.images for record in records] == [[red, green], [green]]
    assert len(report.skipped) == 1
    assert report.skipped[0].startswith(f"{path} row 3: key 'images' image 0 (bytes): not a readable image")

    hf = build_config({"multimodal_keys": '{"image": "picture"}'})  # datasets' Image feature: {bytes, path}
    records, report = load_prompts(path, image_field=image_field(hf.data))
    assert [record.images for record in records] == [[green]]
    assert [problem.removeprefix(f"{path} ") for problem in report.skipped] == [
        "row 1: key 'input' has 2 image item(s) ('<image>' in text or {'type': 'image'} parts) for 1 image(s) in key "
        "'picture'; each image needs one, in order",
        f"row 2: key 'picture' image 0: no image file {tmp_path}/gone.png (and the value is not base64)"]


@pytest.mark.unit
def test_multimodal_keys_parse_from_a_slime_command_line_and_other_media_are_refused_by_name() -> None:
    config, _ = configure(["--prompt-data", "train.parquet", "--input-key", "prompt", "--apply-chat-template",
                           "--multimodal-keys", '{"image": "images"}', "--max-image-pixels", "1000000"])
    assert config.data.multimodal_keys == {"image": "images"}
    assert config.data.image_key == "images"
    assert image_field(config.data).limits.max_pixels == 1_000_000
    assert image_field(build_config({}).data) is None  # text records: no image field is read
    with pytest.raises(SettingsError, match=r"--multimodal-keys .*'video' not supported yet \(supported: image\)"):
        configure(["--multimodal-keys", '{"video": "clips"}'])
    with pytest.raises(SettingsError, match="--multimodal-keys images: 'images' is not JSON"):
        configure(["--multimodal-keys", "images"])
