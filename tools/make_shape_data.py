"""A vision task for the VLM demo: count the shapes in a picture. `python -m tools.make_shape_data OUT_DIR`.

Each picture is 56x56 (four tokens of a Qwen-VL model: one per 28x28 quadrant after the 2x2 patch merge) with one
to four shapes (circles or squares, random colours and sizes, each in its own quadrant); the prompt is
"<image>How many shapes?" and the label the count. Every picture is drawn from its own seed, so the held-out set's
pictures are never seen in training. The records keep their images as PNG files beside the data, named by
relative path, as a user's dataset would (`--multimodal-keys '{"image": "images"}'`).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw

from engines.vision.images import encode_png
from tools.make_arithmetic_data import write_jsonl

SIZE = 56
QUADRANT = SIZE // 2
QUESTION = "<image>How many shapes?"
COLOURS = ((220, 40, 40), (40, 60, 220), (40, 160, 60), (210, 150, 0), (150, 50, 190), (20, 20, 20))


def draw_shapes(rng: random.Random) -> tuple[Image.Image, int]:
    """A white picture with 1-4 shapes, one per chosen quadrant, and how many there are."""
    count = rng.randint(1, 4)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for quadrant in rng.sample(range(4), count):
        left, top = (quadrant % 2) * QUADRANT, (quadrant // 2) * QUADRANT
        radius = rng.randint(8, 12)
        x = left + rng.randint(radius + 1, QUADRANT - radius - 1)
        y = top + rng.randint(radius + 1, QUADRANT - radius - 1)
        box = [x - radius, y - radius, x + radius, y + radius]
        colour = rng.choice(COLOURS)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return image, count


def make_shape_data(out_dir: Path, *, train_size: int = 2000, eval_size: int = 100, sft_size: int = 400,
                    seed: int = 0) -> dict[str, Path]:
    """Write train/eval/sft JSONL files and their pictures under `out_dir`; an existing set is reused."""
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "eval.jsonl", "sft": out_dir / "sft.jsonl"}
    if all(path.exists() for path in paths.values()):
        return paths
    images = out_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    sizes = {"train": train_size, "eval": eval_size, "sft": sft_size}
    for split, size in sizes.items():
        records = []
        for index in range(size):
            picture, count = draw_shapes(random.Random(f"{seed}-{split}-{index}"))
            name = f"images/{split}-{index:05d}.png"
            (out_dir / name).write_bytes(encode_png(picture))
            records.append({"input": QUESTION, "images": [name], "label": str(count)})
        write_jsonl(paths[split], records)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--sft-size", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = make_shape_data(args.out_dir, train_size=args.train_size, eval_size=args.eval_size,
                            sft_size=args.sft_size, seed=args.seed)
    print("\n".join(f"{split}: {path}" for split, path in paths.items()))


if __name__ == "__main__":
    main()
