"""An SGLang-compatible server over the torch engine: `python -m tools.standins.sglang_server --model-path ...`."""
