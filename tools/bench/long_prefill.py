"""One long prompt through the torch engine, prefilled in one forward and in chunks: peak memory and prefill time.

For each prompt length the engine (dynamic cache, no prefix cache, one row) prefills a prompt of random token ids
and samples one token, once with one forward for the whole prompt (`--prefill-chunk-tokens` above the length) and
once in chunks of `--chunk` tokens. Each measurement runs in a process of its own, forked from this one
(tools/bench/forked.py: imports done, no model loaded, a heap no earlier measurement used), which loads the model and
warms the engine up on a short prompt first.

Memory is the process's resident set: the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs after
the warm-up) minus the resident set before the prefill, so loading transients do not hide it. It holds the KV cache
(which any prefill of the prompt keeps: the table's "KV cache" is the bytes of the prompt's keys and values; the
engine's spare columns beyond them are allocated but not touched, so not resident) and the forwards' activations.
Time is the request's wall time to its first token.

SmolLM2-135M serves prompts up to 8,192 positions; a prompt that with its one new token needs more runs on a model of
SmolLM2's shape with random weights and 32,768 positions (the table says which): memory and time depend on the shape,
not on the weights.

    python -m tools.bench.long_prefill [--quick] [--json PATH] [--lengths 2048 4096 8192 16384] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.bench.forked import forked_output

LONG_POSITIONS = 32_768  # the random-weights stand-in's context: room for 16k and 32k prompts
UNCHUNKED = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class PassResult:
    seconds: float
    peak_mib: float  # resident-set high-water mark during the prefill, above the resident set before it
    kv_mib: float  # the prompt's keys and values (fp32): what any prefill of it keeps
    forwards: int  # model forwards the prefill ran


@dataclass(frozen=True)
class Row:
    prompt_tokens: int
    weights: str  # "pretrained" or "random, N positions"
    unchunked: PassResult
    chunked: PassResult


@dataclass(frozen=True)
class Figures:
    model: dict
    chunk_tokens: int
    threads: int
    rows: list[Row]


def run_pass(args: argparse.Namespace) -> None:
    """One prefill in this process: load, warm up, reset the high-water mark, prefill, print what it measured."""
    import torch

    from engines.inference import GenerateRequest, SamplingParams, TorchEngine

    model = load_model(args.pass_model, args.pass_positions)
    config = model.config
    chunk = args.pass_chunk or UNCHUNKED
    engine = TorchEngine(model, None, max_batch_size=1, max_batch_tokens=args.pass_length + 64,
                         prefill_chunk_tokens=chunk, prefix_cache_bytes=0, seed=0)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    prompt = torch.randint(3, config.vocab_size, (args.pass_length,), generator=torch.Generator().manual_seed(0))

    async def measure() -> PassResult:
        await engine.generate(GenerateRequest("warm", prompt[:64].tolist(), params))
        forwards.clear()
        reset_peak()
        before = resident_mib("VmRSS")
        start = time.perf_counter()
        await engine.generate(GenerateRequest("long", prompt.tolist(), params))
        seconds = time.perf_counter() - start
        peak = resident_mib("VmHWM") - before
        await engine.close()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * args.pass_length * 4
        return PassResult(seconds, peak, kv_bytes / MIB, len(forwards))

    print(json.dumps(asdict(asyncio.run(measure()))))


def load_model(path: Path, positions: int | None) -> object:
    """The folder's model, or (with `positions`) a model of its shape with random weights and that many positions."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if positions is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = positions
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def reset_peak() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux 4.0+: `5` to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as error:
        raise RuntimeError(f"bench long_prefill: cannot reset the resident-set high-water mark through "
                           f"/proc/self/clear_refs ({error}); the benchmark needs Linux") from error


def resident_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"bench long_prefill: /proc/self/status has no {field}")


def timed_pass(model: Path, length: int, chunk: int | None, positions: int | None, args: argparse.Namespace,
               threads: int, scratch: Path) -> PassResult:
    """One prefill in a fresh process, forked from this one."""
    import torch

    one = argparse.Namespace(**{**vars(args), "pass_": "prefill", "pass_model": model, "pass_length": length,
                                "pass_chunk": chunk, "pass_positions": positions})

    def side() -> None:
        torch.set_num_threads(threads)
        run_pass(one)

    name = f"{length}-{'chunked' if chunk else 'unchunked'}"
    errors = scratch / f"{name}.err"
    code, output = forked_output(side, errors)
    if code != 0:
        raise RuntimeError(f"bench long_prefill: the {name} pass exited with {code}:\n{errors.read_text()[-3000:]}")
    return PassResult(**json.loads(output.strip().splitlines()[-1]))


def benchmark(args: argparse.Namespace) -> Figures:
    import torch
    from transformers import AutoConfig

    import engines.inference  # noqa: F401  (imported once here, in every forked pass already)

    threads = args.threads
    torch.set_num_threads(1)  # the passes fork from here (tools/bench/forked.py)
    path = model_path(args)
    config = AutoConfig.from_pretrained(path)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-long-prefill-") as scratch:
        for length in args.lengths:
            positions = None if length + 1 <= config.max_position_embeddings else max(LONG_POSITIONS, 2 * length)
            weights = "pretrained" if positions is None else f"random, {positions} positions"
            if args.quick:
                weights = "tiny random" if positions is None else f"tiny random, {positions} positions"
            unchunked = timed_pass(path, length, None, positions, args, threads, Path(scratch))
            chunked = timed_pass(path, length, args.chunk, positions, args, threads, Path(scratch))
            rows.append(Row(length, weights, unchunked, chunked))
    return Figures(
        model={"name": "quick" if args.quick else "smollm2", "hidden_size": config.hidden_size,
               "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
               "num_key_value_heads": config.num_key_value_heads, "max_position_embeddings":
               config.max_position_embeddings},
        chunk_tokens=args.chunk, threads=threads, rows=rows,
    )


def model_path(args: argparse.Namespace) -> Path:
    if args.quick:
        from tools.bench.engine import QUICK_SPEC
        from tools.standins.tiny_model import cached_tiny_model

        cache_dir = Path(args.model_cache or Path(tempfile.gettempdir()) / "slipstream-bench-models")
        return cached_tiny_model(cache_dir, QUICK_SPEC)
    from tools.bench.models import bench_model

    return bench_model("smollm2")


def print_table(figures: Figures) -> None:
    model = figures.model
    print(f"model: {model['name']} hidden={model['hidden_size']} layers={model['num_hidden_layers']} "
          f"heads={model['num_attention_heads']}/{model['num_key_value_heads']} (fp32, CPU, {figures.threads} "
          f"threads) | one prompt, one new token | chunked: {figures.chunk_tokens} tokens per forward | peak: "
          "resident-set high-water mark above the warmed-up engine, MiB")
    print(f"{'prompt':>7}  {'weights':<26}{'KV cache':>9}{'one forward':>13}{'chunked':>9}{'above KV cache':>16}"
          f"{'one forward':>13}{'chunked':>9}{'forwards':>10}")
    print(f"{'tokens':>7}  {'':<26}{'MiB':>9}{'peak MiB':>13}{'peak MiB':>9}{'one / chunked':>16}{'seconds':>13}"
          f"{'seconds':>9}{'chunked':>10}")
    for row in figures.rows:
        whole, chunked = row.unchunked, row.chunked
        above = f"{whole.peak_mib - whole.kv_mib:.0f} / {chunked.peak_mib - chunked.kv_mib:.0f}"
        print(f"{row.prompt_tokens:>7}  {row.weights:<26}{whole.kv_mib:>9.0f}{whole.peak_mib:>13.0f}"
              f"{chunked.peak_mib:>9.0f}{above:>16}{whole.seconds:>13.1f}{chunked.seconds:>9.1f}"
              f"{chunked.forwards:>10}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run on the smallest tiny model")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--model-cache", type=Path, help="where the --quick tiny model is built (default: tmp)")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="prompt lengths in tokens (default 2048 4096 8192 16384; 1536 with --quick)")
    parser.add_argument("--chunk", type=int, help="tokens per chunked forward (default 2048; 64 with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--pass", dest="pass_", choices=("prefill",), help=argparse.SUPPRESS)
    parser.add_argument("--pass-model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pass-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pass-chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pass-positions", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([1536] if args.quick else [2048, 4096, 8192, 16384])
    args.chunk = args.chunk or (64 if args.quick else 2048)
    for length in args.lengths:
        if length < 2:
            parser.error(f"--lengths: each must be >= 2, got {length}")
    if args.chunk < 1:
        parser.error(f"--chunk must be >= 1, got {args.chunk}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.passes import run_benchmark

    return run_benchmark(parse_args(argv), run_pass=run_pass, benchmark=benchmark, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
