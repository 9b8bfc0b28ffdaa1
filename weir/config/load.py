"""YAML loading, dotted command-line overrides, and validation errors that name the key and the fix."""

from __future__ import annotations

import copy
import difflib
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from weir.config.schema import Config


class ConfigError(ValueError):
    """A user-fixable problem in a config file or override; the message names the key."""


def _fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """Valid field names of the section that `path` points into."""
    for part in path[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(Config, loc)
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = (
                f"did you mean '{'.'.join(str(p) for p in loc[:-1] + (near[0],))}'?" if near else ""
            )
            lines.append(f"unknown key '{key}'. {hint} Valid keys here: {', '.join(valid)}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key}: {e['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_value(text: str) -> Any:
    """Parse an override value as YAML, so `8`, `1e-4`, `true`, `null`, `[1, 2]` get their types."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (in place, returned)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. rollout.n=8)")
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key!r}: '{part}' is a value, not a section")
            node = nxt
        node[parts[-1]] = parse_value(value)
    return data


RENAMED = {("engine", "kv_cache_gb"): ("engine", "kv_budget_gb")}
"""Keys a run directory's config.yaml may still hold from an older weir: old -> new."""


def _migrate_renamed(data: dict[str, Any]) -> None:
    """Move renamed keys to their new names (unless those are set), with a FutureWarning."""
    for (section, old), (new_section, new) in RENAMED.items():
        node = data.get(section)
        if not isinstance(node, dict) or old not in node:
            continue
        value = node.pop(old)
        warnings.warn(
            f"{section}.{old} is now {new_section}.{new}; rename it in your config",
            FutureWarning,
            stacklevel=3,
        )
        target = data.setdefault(new_section, {})
        if isinstance(target, dict) and target.get(new) is None:
            target[new] = value


def build_config(data: dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a dict (plus overrides) into a Config, raising ConfigError with readable messages."""
    data = apply_overrides(
        copy.deepcopy(dict(data or {})), list(overrides or [])
    )  # never the caller's
    _migrate_renamed(data)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded or {}
    return build_config(data, overrides)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
