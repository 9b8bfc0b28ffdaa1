"""MkDocs hook (mkdocs.yml `hooks:`): pages generated from the code when the site is built.

reference/cli.md is written from the `weir` command itself (weir.cli.reference), so the command-line
reference cannot drift from the code and nothing generated is committed for it.
"""

from __future__ import annotations

from mkdocs.structure.files import File


def on_files(files, config):
    from weir.cli.reference import cli_reference

    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    return files
