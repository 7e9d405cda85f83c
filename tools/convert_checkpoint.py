"""Convert a Hugging Face model folder to a Megatron distributed checkpoint, and back.

    python tools/convert_checkpoint.py hf-to-megatron --hf MODEL_DIR --out MEGATRON_DIR
    python tools/convert_checkpoint.py megatron-to-hf --hf MODEL_DIR --megatron MEGATRON_DIR --out HF_DIR

A distributed checkpoint reshards on load, so converting in one process (TP=PP=1) serves any later layout; pass
it to a run as `--megatron-checkpoint`. `megatron-to-hf` also accepts a trainer checkpoint (its optimizer state
is ignored); `--hf` supplies the architecture, tokenizer and config of the exported folder. Runs on CPU (through
`engines.megatron.cpu_compat`) or GPU alike, as one world-size-1 process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engines.megatron.convert import export_megatron_to_hf, save_hf_as_megatron  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF folder -> Megatron distributed checkpoint")
    to_megatron.add_argument("--hf", type=Path, required=True, help="Hugging Face model folder")
    to_megatron.add_argument("--out", type=Path, required=True, help="directory to create")
    to_hf = commands.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF folder")
    to_hf.add_argument("--hf", type=Path, required=True, help="HF folder giving architecture, config, tokenizer")
    to_hf.add_argument("--megatron", type=Path, required=True, help="distributed checkpoint directory")
    to_hf.add_argument("--out", type=Path, required=True, help="directory to create")
    args = parser.parse_args(argv)
    if args.command == "hf-to-megatron":
        save_hf_as_megatron(args.hf, args.out)
    else:
        export_megatron_to_hf(args.hf, args.megatron, args.out)
    print(json.dumps({"command": args.command, "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
