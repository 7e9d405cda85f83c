"""Configuration errors: a setting that cannot work, as opposed to a crash.

The difference matters to the launcher. An actor that crashes is restarted; one whose configuration is wrong
would only fail the same way again, so it exits with its own code (`actors.runtime.main`) and the launcher fails
the run at once with the actor's message. The launcher's preflight (`actors.config.preflight`) catches what it
can before any actor starts; these are what only the actor that uses a setting can find.
"""

from __future__ import annotations

from policies.plugins import PluginError


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag, its value and what is wrong, e.g.
    `--prompt-data data/train.jsonl: no usable records (3 skipped; first: line 1: key 'input' missing)`."""


# What an actor raises for its configuration: ours, and a `module:attr` plugin path that does not load.
CONFIG_ERRORS: tuple[type[Exception], ...] = (ConfigError, PluginError)
