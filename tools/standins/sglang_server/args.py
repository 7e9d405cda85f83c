"""The compatible server's command line: SGLang's core launch arguments, and any other `--flag [value]` kept aside.

A command line written for `sglang.launch_server` starts `python -m tools.standins.sglang_server` unchanged: the
arguments this server implements are parsed as SGLang parses them, the rest are returned in `ignored` (the server
warns about them).
"""

from __future__ import annotations

import argparse

import torch

from engines.sglang import protocol

SGLANG_APIS = protocol.SUPPORTED_SGLANG
DTYPES = {
    "auto": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.standins.sglang_server", description="an SGLang-compatible server over the torch engine"
    )
    parser.add_argument("--model-path", required=True, help="local Hugging Face model folder")
    parser.add_argument("--tokenizer-path", default=None, help="accepted for SGLang compatibility; unused")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--weight-version", default=protocol.INITIAL_WEIGHT_VERSION)
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant log-probs (as SGLang's flag gives); reported in /server_info. Seeds are honoured with "
        "or without it",
    )
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record each token's experts (an MoE model) and return them where a request asks")
    parser.add_argument(
        "--sglang-api",
        choices=SGLANG_APIS,
        default=SGLANG_APIS[-1],
        help="which SGLang release's behaviour to serve (weight-update sessions, per-token version spans)",
    )
    # The next two default to what a Slipstream run launching this server has by default (--weight-transfer-timeout,
    # --torch-threads), so the run needs no special arguments for its stand-in; pass --sglang-NAME to change them.
    parser.add_argument(
        "--weight-group-timeout", type=float, default=30.0,
        help="seconds a weight update group waits for all members (a run's --weight-transfer-timeout default)"
    )
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="accepted; memory is always releasable here")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="released weights come back as they were (without it, as NaN)")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded by name")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8,
                        help="adapters loaded at once (SGLang's: per batch, more kept in host memory)")
    lora_modules = [*protocol.LORA_TARGET_MODULES, protocol.LORA_ALL_MODULES]
    parser.add_argument("--lora-target-modules", nargs="*", default=None, choices=lora_modules)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch CPU threads (a run's --torch-threads default; 0: torch's own choice)")
    # A fault for tests (server.py's docstring): updates past the first N are acknowledged and not loaded.
    parser.add_argument("--drop-weight-updates-after", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="info")
    args, unknown = parser.parse_known_args(argv)
    args.ignored = unknown
    if args.enable_lora and not (args.max_lora_rank and args.lora_target_modules):
        # SGLang's own check (it also accepts initial --lora-paths, which this server does not load)
        parser.error("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                     "--lora-target-modules for LoRA initialization.")
    if args.enable_lora and args.enable_deterministic_inference:
        parser.error("--enable-lora with --enable-deterministic-inference: this compatible server serves adapters "
                     "unmerged beside the base weights, which its batch-invariant kernels do not cover yet")
    if args.max_loras_per_batch < 1:
        parser.error(f"--max-loras-per-batch must be at least 1, got {args.max_loras_per_batch}")
    return args
