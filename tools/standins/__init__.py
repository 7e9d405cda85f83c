"""Stand-ins for what this CPU box lacks, for tests, benchmarks and the demo: never imported by the product.

`tiny_model` builds small Hugging Face checkpoints locally (no hub here); `sglang_server` is an SGLang-compatible
HTTP server over our torch engine (real SGLang needs a GPU), started as `--sglang-server-module
tools.standins.sglang_server`, so the SGLang client, weight sync, LoRA and memory paths run for real on a CPU.
"""
