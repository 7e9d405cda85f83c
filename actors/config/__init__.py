"""The run's configuration: sections per component (`sections`), the whole run and its cross-section rules
(`run`), and the flat slime-style flags and YAML keys that fill it (`flags`)."""

from actors.config.errors import CONFIG_ERRORS, ConfigError
from actors.config.flags import (
           add_config_flags,
           build_config,
           config_from_args,
           split_sglang_args,
           write_effective_config,
)
from actors.config.run import RunConfig

__all__ = ["CONFIG_ERRORS", "ConfigError", "RunConfig", "add_config_flags", "build_config",
           "config_from_args", "split_sglang_args", "write_effective_config"]
