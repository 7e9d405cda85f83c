"""Convert a Hugging Face model folder into its FP8 checkpoint, the form an SGLang server serves FP8 rollout from.

    python -m tools.convert_fp8 SRC DST [--block 128]

DST gets SRC's decoder projections as float8_e4m3fn values with a float32 scale per BLOCK x BLOCK tile
(`<module>.weight`, `<module>.weight_scale_inv`: the bytes the learner pushes under --rollout-fp8), every other
tensor as stored, the tokenizer and generation files, and config.json with the `quantization_config` SGLang and
transformers read. A run that launches its SGLang servers converts --hf-checkpoint itself (once, cached); this is for
servers started by hand and attached with --sglang-url. SGLang needs the projections' per-shard sizes in whole tiles:
pass --tp-size to have that checked for the tensor-parallel size the server will run with.
"""

from __future__ import annotations

import argparse
import sys

from engines.weights import fp8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an unquantised Hugging Face model folder (safetensors weights)")
    parser.add_argument("target", help="the FP8 checkpoint folder to write (must not exist)")
    parser.add_argument("--block", type=int, default=fp8.BLOCK, help="the tile size (SGLang's weight_block_size)")
    parser.add_argument("--tp-size", type=int, default=None,
                        help="check that SGLang can serve it over this many tensor-parallel ranks")
    args = parser.parse_args(argv)
    from engines.checkpoint_config import Fp8CheckpointError, read_config
    from engines.fp8_checkpoint import convert
    from engines.sglang.fp8_serving import block_shape_problems

    try:
        if args.tp_size is not None:
            problems = block_shape_problems(read_config(args.source), args.tp_size, args.source, args.block)
            if problems:
                raise Fp8CheckpointError(problems[0])
        print(convert(args.source, args.target, args.block))
    except Fp8CheckpointError as error:
        print(f"convert_fp8: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
