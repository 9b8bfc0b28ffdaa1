"""Code rewards: run the program in a response in the sandbox and score it by tests.

- ``code_tests``: the row's unit tests (``row["tests"]``: Python snippets such as
  ``assert f(2) == 4``) run in a judge process apart from the program, calling its functions
  across the process boundary with plain values (`weir.sandbox.judge`); reward = fraction passed
  (``mode="fraction"``) or 1 only if all pass (``mode="all"``).
- ``code_io``: stdin/stdout cases (``row["cases"]``: ``[{"input": "1 2\\n", "output": "3"}]``), one
  execution each; reward = fraction of cases whose output matches, or all-or-nothing.

The program is extracted from the response by `extract_code`. A row may carry ``"prefix"``: code put
before the program (HumanEval's prompt: the signature and docstring the response completes, or
re-defines), which the judge also runs as trusted code before the tests (its imports and helpers
are the tests', not the program's); ``"entry_point"``: the name (or list of names) of the
functions under test, the only ones taken from the program when given; and ``"stop"``: strings at
which a completion is cut (HumanEval's ``"\\ndef "`` ...).

What the program does (a timeout, a memory bomb, a denied operation) scores 0 for the tests it did not
pass and is counted; only the sandbox's own failure (it could not start the program) fails the sample,
like any reward error. Every call adds ``reward/exec_*`` counters to the sample's metrics.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from weir.data.sample import Sample
from weir.sandbox import ExecResult, Sandbox, default_sandbox

__all__ = ["extract_code", "code_tests", "code_io", "exec_metrics", "build_program"]

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_TAGS = {"", "python", "py", "python3"}
Extract = Literal["auto", "last_block", "first_block", "whole"]
_LIMIT_STATUSES = ("cpu_time", "memory", "processes", "output_limit", "file_size", "disk")


def extract_code(
    text: str, how: Extract = "auto", language: str = "python"
) -> tuple[str | None, str]:
    """(the program in `text`, how it was found).

    Fenced blocks (```` ```python ... ``` ````; an unclosed last fence runs to the end) in
    `language` or untagged count. ``last_block`` / ``first_block`` take that block (None without
    one); ``whole`` takes the text; ``auto`` takes the last block, else the whole text.
    """
    tags = _PY_TAGS if language == "python" else {"", language}
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in tags]
    if how == "whole":
        return text, "whole"
    if how in ("last_block", "first_block"):
        if not blocks:
            return None, "no_block"
        return (blocks[-1] if how == "last_block" else blocks[0]), how
    if how != "auto":
        raise ValueError(f"extract={how!r}: choose auto, last_block, first_block or whole")
    if blocks:
        return blocks[-1], "last_block"
    return text, "whole"


def build_program(code: str, row: Mapping[str, Any], *, extracted_how: str) -> str:
    """`code` with the row's ``prefix`` before it; a completion (whole text) is cut at the row's
    ``stop`` strings first."""
    if extracted_how == "whole":
        for stop in row.get("stop") or ():
            cut = code.find(stop)
            if cut >= 0:
                code = code[:cut]
    prefix = row.get("prefix") or ""
    if prefix and not prefix.endswith("\n") and not code.startswith("\n"):
        prefix += "\n" if re.match(r"\s*(def|class|import|from|@)\b", code) else ""
    return prefix + code


def exec_metrics(results: Sequence[ExecResult]) -> dict[str, float]:
    """Per-sample sandbox counters (summed and averaged per step as ``reward/exec_*``)."""
    n = len(results)
    out = {
        "reward/exec_count": float(n),
        "reward/exec_seconds": sum(r.wall_s for r in results),
        "reward/exec_cpu_seconds": sum(r.cpu_s for r in results),
        "reward/exec_queue_seconds": sum(r.queue_s for r in results),
        "reward/exec_ok": float(sum(r.status == "ok" for r in results)),
        "reward/exec_timeout": float(sum(r.status == "timeout" for r in results)),
        "reward/exec_limit": float(sum(r.status in _LIMIT_STATUSES for r in results)),
        "reward/exec_denied": float(sum(r.status == "denied" for r in results)),
        "reward/exec_error": float(sum(r.status == "error" for r in results)),
        "reward/exec_sandbox_error": float(sum(r.status == "sandbox_error" for r in results)),
    }
    return out


def _record(sample: Sample, results: Sequence[ExecResult]) -> None:
    metrics = sample.metadata.setdefault("metrics", {})
    for k, v in exec_metrics(results).items():
        metrics[k] = metrics.get(k, 0.0) + v


def _response_code(
    sample: Sample, row: Mapping[str, Any], extract: Extract
) -> tuple[str | None, str]:
    code, how = extract_code(_strip_trailing_eos(sample.response_text), extract)
    if code is None or not code.strip():
        return None, how if code is None else "empty"
    return build_program(code, row, extracted_how=how), how


def _strip_trailing_eos(text: str) -> str:
    """`text` without trailing whitespace and end-of-sequence markers; leading indentation is kept
    (a completion's first line is indented)."""
    from weir.rollout.rewards import DEFAULT_EOS_TEXTS

    text, changed = text.rstrip(), True
    while changed:
        changed = False
        for eos in DEFAULT_EOS_TEXTS:
            if text.endswith(eos):
                text, changed = text[: -len(eos)].rstrip(), True
    return text + "\n"


def _check_sandbox_failure(results: Sequence[ExecResult]) -> None:
    bad = [r for r in results if r.status == "sandbox_error"]
    if bad:
        raise RuntimeError(f"sandbox failure: {bad[0].reason}")


def code_tests(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    tests_key: str = "tests",
    mode: Literal["fraction", "all"] = "fraction",
    extract: Extract = "auto",
    sandbox: Sandbox | None = None,
) -> dict[str, Any]:
    """Reward = fraction of ``row[tests_key]`` passed (``mode="fraction"``), or 1.0 only when all
    pass (``"all"``); 0 when the response holds no code.

    Returns ``{"reward", "tests_passed", "tests", "exec_status", "exec_reason", "extracted"}``.
    """
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests: mode must be 'fraction' or 'all', got {mode!r}")
    tests = row.get(tests_key)
    if isinstance(tests, str):
        tests = [tests]
    if not tests:
        raise ValueError(
            f"code_tests: row has no tests under {tests_key!r} (keys: {sorted(row)}); "
            "set tests_key to the field holding a list of test snippets"
        )
    program, how = _response_code(sample, row, extract)
    if program is None:
        return {
            "reward": 0.0,
            "tests_passed": 0,
            "tests": len(tests),
            "exec_status": "no_code",
            "exec_reason": "",
            "extracted": how,
        }
    entry = row.get("entry_point")
    result = (sandbox or default_sandbox()).run(
        program,
        tests=list(tests),
        prefix=row.get("prefix") or None,
        entry_points=[entry] if isinstance(entry, str) else entry,
    )
    _record(sample, [result])
    _check_sandbox_failure([result])
    passed = result.passed
    frac = passed / len(tests)
    reward = frac if mode == "fraction" else float(passed == len(tests))
    return {
        "reward": reward,
        "tests_passed": passed,
        "tests": len(tests),
        "exec_status": result.status,
        "exec_reason": result.reason,
        "extracted": how,
    }


def _normalize_output(text: str, compare: str) -> Any:
    if compare == "exact":
        return text
    if compare == "lines":
        return [ln.rstrip() for ln in text.rstrip().splitlines()]
    return text.split()


def code_io(
    sample: Sample,
    row: Mapping[str, Any],
    *,
    cases_key: str = "cases",
    mode: Literal["fraction", "all"] = "fraction",
    compare: Literal["tokens", "lines", "exact"] = "tokens",
    extract: Extract = "auto",
    sandbox: Sandbox | None = None,
) -> dict[str, Any]:
    """Reward from stdin/stdout cases: each case runs the program once with ``case["input"]`` on
    stdin and passes when its stdout equals ``case["output"]`` (``tokens``: the same
    whitespace-separated tokens; ``lines``: the same lines up to trailing spaces; ``exact``).
    ``mode="all"`` stops at the first failing case.

    Returns ``{"reward", "cases_passed", "cases", "exec_status", "exec_reason", "extracted"}``.
    """
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_io: mode must be 'fraction' or 'all', got {mode!r}")
    if compare not in ("tokens", "lines", "exact"):
        raise ValueError(f"code_io: compare must be tokens, lines or exact, got {compare!r}")
    cases = row.get(cases_key)
    if not cases or not all(isinstance(c, Mapping) and "output" in c for c in cases):
        raise ValueError(
            f"code_io: row field {cases_key!r} must be a list of {{'input', 'output'}} cases"
        )
    program, how = _response_code(sample, row, extract)
    if program is None:
        return {
            "reward": 0.0,
            "cases_passed": 0,
            "cases": len(cases),
            "exec_status": "no_code",
            "exec_reason": "",
            "extracted": how,
        }
    box = sandbox or default_sandbox()
    results, passed, first_bad = [], 0, None
    for case in cases:
        r = box.run(program, stdin=str(case.get("input", "")), args=list(case.get("args", ())))
        results.append(r)
        if r.status == "sandbox_error":
            break
        ok = r.status == "ok" and _normalize_output(r.stdout, compare) == _normalize_output(
            str(case["output"]), compare
        )
        passed += ok
        if not ok and first_bad is None:
            first_bad = r
            if mode == "all":
                break
    _record(sample, results)
    _check_sandbox_failure(results)
    reward = passed / len(cases) if mode == "fraction" else float(passed == len(cases))
    shown = first_bad or results[-1]
    reason = shown.reason if shown.status != "ok" else ("wrong output" if first_bad else "")
    return {
        "reward": reward,
        "cases_passed": passed,
        "cases": len(cases),
        "exec_status": shown.status,
        "exec_reason": reason,
        "extracted": how,
    }
