"""Generate the configuration reference (docs/configuration.md) from the pydantic models."""

from __future__ import annotations

from pydantic import BaseModel

from weir.config.schema import Config


def _type_name(ann: object) -> str:
    text = str(ann).replace("typing.", "")
    if isinstance(ann, type):
        text = ann.__name__
    return text.replace("NoneType", "None")


def _constraints(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default!r}`"


def config_reference() -> str:
    """Markdown tables, one per section, with every key's type, default, range and meaning."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `weir/config/schema.py` by `weir config-docs`; do not edit by hand.",
        "Set keys in a YAML file or override them on the command line: `weir train CONFIG rollout.n=8`.",
        "",
    ]

    def section(model: type[BaseModel], prefix: str) -> None:
        rows, subsections = [], []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subsections.append((ann, f"{prefix}{name}."))
                continue
            desc = (field.description or "").replace("\n", " ").replace("|", "\\|")
            kind = _type_name(ann).replace("|", "\\|")
            rows.append(
                f"| `{prefix}{name}` | {kind} | {_default(field)} | {_constraints(field)} | {desc} |"
            )
        if rows:
            lines.extend(
                [
                    f"## `{prefix.rstrip('.')}`",
                    "",
                    "| key | type | default | range | meaning |",
                    "| --- | --- | --- | --- | --- |",
                    *rows,
                    "",
                ]
            )
        for sub, p in subsections:
            section(sub, p)

    section(Config, "")
    return "\n".join(lines)


__all__ = ["config_reference"]
