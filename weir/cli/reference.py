"""The command-line reference (the docs site's reference/cli.md), generated from the `weir` command
itself so that it cannot drift: each command's usage, help text and parameters."""

from __future__ import annotations

import typer.main


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def cli_reference() -> str:
    """Markdown: one section per `weir` command with its usage line, its docstring and a table of
    its arguments and options (the text `weir COMMAND --help` prints)."""
    from weir.cli.main import app

    group = typer.main.get_command(app)
    lines = [
        "# Command line",
        "",
        "Generated from the `weir` command when the site is built (`weir COMMAND --help` prints the",
        "same). A config file plus dotted overrides is how `train`, `sft` and `demo` take settings:",
        "[configuration.md](../configuration.md) lists every key.",
        "",
    ]
    root = group.make_context("weir", [], resilient_parsing=True)
    _commands(group, root, "weir", lines)
    return "\n".join(lines)


def _commands(group, parent, prefix: str, lines: list[str]) -> None:
    """Append a section per command of `group`, recursing into sub-groups (`weir model fetch`)."""
    for name, command in group.commands.items():
        ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
        if hasattr(command, "commands"):
            _commands(command, ctx, f"{prefix} {name}", lines)
            continue
        records = [
            rec
            for param in command.params
            if param.name != "help" and (rec := param.get_help_record(ctx))
        ]
        pieces = [p for param in command.params for p in param.get_usage_pieces(ctx)]
        options = ["[OPTIONS]"] if any(flag.startswith("-") for flag, _ in records) else []
        usage = " ".join([prefix, name, *options, *pieces])
        lines += [f"## `{prefix} {name}`", "", "```text", usage, "```", ""]
        lines += [(command.help or "").strip(), ""]
        if records:
            lines += ["| argument or option | meaning |", "| --- | --- |"]
            lines += [f"| `{_cell(flag)}` | {_cell(text)} |" for flag, text in records]
            lines.append("")


__all__ = ["cli_reference"]
