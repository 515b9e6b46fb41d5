"""Typed config tree, its YAML loader and the generated reference (docs/config_reference.md)."""

from pfppo_mega.config.loader import (
    AliasUse,
    IgnoredUse,
    Resolved,
    ValueAliasUse,
    apply_overrides,
    config_to_dict,
    dump_yaml,
    load_config,
    load_config_cli,
    load_config_dict,
    output_dir_problem,
    resolve_config,
    resolve_config_dict,
    validate_main,
)
from pfppo_mega.config.tree import Config, ConfigError, Problem

__all__ = [
    "AliasUse", "Config", "ConfigError", "IgnoredUse", "Problem", "Resolved", "ValueAliasUse",
    "apply_overrides", "config_to_dict", "dump_yaml", "load_config", "load_config_cli",
    "load_config_dict", "output_dir_problem", "resolve_config", "resolve_config_dict",
    "validate_main",
]
