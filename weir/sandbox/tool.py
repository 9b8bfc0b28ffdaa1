"""The `python` tool: an agent runs code in the sandbox and sees what it printed.

Config: ``agent.tools: [weir.sandbox.tool:python]``. It runs in the process-wide sandbox
(`weir.sandbox.default_sandbox`, set from the `sandbox` config section), under the same limits and
isolation as code rewards. Through the OpenAI-compatible server an agent passes `tool_schema(python)`
in ``tools`` and runs the returned calls with `weir.rollout.tools.call_tool`.
"""

from __future__ import annotations

from weir.sandbox import default_sandbox

__all__ = ["python", "MAX_TOOL_OUTPUT"]

MAX_TOOL_OUTPUT = 2000  # characters of output shown to the model


def python(code: str) -> str:
    """Run a Python program in a sandbox and return its output (stdout, then stderr).

    Args:
        code: a complete Python program; print what you want to see.
    """
    r = default_sandbox().run(code)
    text = r.stdout
    if r.stderr.strip():
        text += ("\n" if text and not text.endswith("\n") else "") + r.stderr
    if r.status not in ("ok", "error"):
        text += f"\n[sandbox: {r.reason}]"
    text = text.rstrip("\n")
    if len(text) > MAX_TOOL_OUTPUT:
        cut = len(text) - MAX_TOOL_OUTPUT
        text = (
            text[: MAX_TOOL_OUTPUT // 2]
            + f"\n[... {cut} characters cut ...]\n"
            + text[-MAX_TOOL_OUTPUT // 2 :]
        )
    return text
