"""Typed configuration: `Config`, YAML loading and dotted overrides."""

from weir.config.load import ConfigError, apply_overrides, build_config, dump_config, load_config
from weir.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_overrides", "build_config", "dump_config", "load_config"]
