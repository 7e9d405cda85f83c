"""The built-in weight transports' names, apart so the mechanisms can stamp them on their group specs without
importing the registry (which imports the mechanisms)."""

TORCH_DISTRIBUTED = "torch_distributed"
SGLANG = "sglang"
SGLANG_LORA = "sglang_lora"
SGLANG_TENSOR = "sglang_tensor"
DISK = "disk"
SGLANG_DISK = "sglang_disk"
