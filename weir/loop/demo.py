"""`weir demo`: tiny model -> SFT warm start -> GRPO -> held-out accuracy before and after; a
pretrained model (`smollm2_arithmetic`: SmolLM2-135M-Instruct, docs/real-models.md) skips the warm
start and RL starts from the model as it is.

`--task` picks examples/<task>.yaml (shipped in the package as weir/examples): `arithmetic` (default), `calculator` (a tool-using agent),
`relay` (two roles learning together: each computes a part the other needs, docs/multi-agent.md),
`proposer_checker` (two roles; the checker learns the base rate, not to verify),
`code` (functions written from a spec, rewarded by hidden tests run in the sandbox), `shapes` (a
tiny Qwen2.5-VL counts shapes and names their colour in PIL images), `gui` (the tiny Qwen2.5-VL
as a GUI agent on PIL screens: SFT, action-level RL, then task-level RL; `weir.loop.demo_stages`)
or `smollm2_arithmetic` (a real pretrained model learns two-digit additions asked in words).
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from weir.config import load_config
from weir.loop.demo_stages import STAGES, run_staged_demo
from weir.loop.sft import run_sft
from weir.loop.sync import run_sync

# The example configs ship inside the package (weir/examples, a link to the checkout's examples/ that
# the wheel carries as files): the demo runs the same after `pip install weir` as in a checkout.
EXAMPLES = Path(str(resources.files("weir") / "examples"))


def demo_config_path(task: str) -> Path:
    path = EXAMPLES / f"{task}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
        raise ValueError(f"no demo config for task {task!r} at {path}; known: {known}")
    return path


def run_demo(
    task: str, out: Path, overrides: list[str], console: Console | None = None
) -> dict[str, Any]:
    """Run the demo end to end; returns (and writes to out/demo.json) the before/after summary.

    "after" is the mean of the last three evaluations, since one evaluation swings by a few points;
    a pretrained model's demo, whose run is a few steps with evaluations five steps apart, shows
    the last evaluation (both are in the summary). A demo in several RL stages (`STAGES`) reports
    each stage's first and last evaluations instead (`weir.loop.demo_stages`).
    """
    console = console or Console()
    path = demo_config_path(task)
    if task in STAGES:  # several RL stages (SFT, action-level, then task-level RL for gui)
        return run_staged_demo(task, EXAMPLES, out, overrides, console)
    t0 = time.perf_counter()
    base = load_config(path, overrides)
    # weir's tiny models start from random weights and need the warm start; a pretrained model
    # (a real one: examples/smollm2_arithmetic.yaml) starts RL as it is
    pretrained = not base.model.path.startswith(("tiny:", "tiny-vlm:"))
    model_override: list[str] = []
    if not pretrained:
        console.rule(f"[bold]weir demo: {task}[/bold] — 1/2 supervised warm start")
        sft_cfg = load_config(path, [*overrides, f"run.dir={out / 'sft'}"])
        model_override = [f"model.path={run_sft(sft_cfg)}"]
        console.rule("2/2 reinforcement learning (GRPO)")
    else:
        console.rule(f"[bold]weir demo: {task}[/bold] — RL (GRPO) on {base.model.path}")
    t_sft = time.perf_counter() - t0
    rl_cfg = load_config(  # a demo starts fresh, even where an older demo left checkpoints
        path,
        [
            "run.resume=never",
            "telemetry.dump_rollouts=true",  # sample responses for the report
            *overrides,
            f"run.dir={out / 'rl'}",
            *model_override,
        ],
    )
    result = run_sync(rl_cfg)
    total = time.perf_counter() - t0
    accs = [e["eval/accuracy"] for e in result.evals]
    last = accs[-3:]
    summary = {
        "pretrained": float(pretrained),
        "accuracy_before_rl": accs[0],
        "accuracy_after_rl_last3_mean": sum(last) / len(last),
        "accuracy_after_rl_last": accs[-1],
        "eval_prompts": result.evals[0]["eval/prompts"],
        "sft_seconds": t_sft,
        "rl_seconds": total - t_sft,
        "total_seconds": total,
        "rl_steps": rl_cfg.run.steps,
    }
    if not pretrained:
        summary["accuracy_after_sft"] = accs[0]
    summary.update(role_summary(result.evals))
    summary.update(breakdown_summary(result.evals))
    calls = [h["agent/tool_calls_mean"] for h in result.history if "agent/tool_calls_mean" in h]
    if calls:  # a tool-using agent: how often it called a tool per episode, first and last steps
        summary["tool_calls_per_episode_first3"] = sum(calls[:3]) / len(calls[:3])
        summary["tool_calls_per_episode_last3"] = sum(calls[-3:]) / len(calls[-3:])
    temp = rl_cfg.eval.temperature
    how = "greedy" if temp == 0 else f"sampled (T={temp:g}, {rl_cfg.eval.n} per problem)"
    table = Table(title=f"held-out {how} accuracy ({int(summary['eval_prompts'])} problems)")
    for col in ("stage", "accuracy", "minutes"):
        table.add_column(col)
    if pretrained:
        table.add_row("before RL (the pretrained model)", f"{accs[0]:.1%}", "")
        table.add_row(
            f"after RL (step {rl_cfg.run.steps})",
            f"{summary['accuracy_after_rl_last']:.1%}",
            f"{(total - t_sft) / 60:.1f}",
        )
    else:
        table.add_row("after SFT", f"{accs[0]:.1%}", f"{t_sft / 60:.1f}")
        table.add_row(
            "after RL (mean of last 3 evals)",
            f"{summary['accuracy_after_rl_last3_mean']:.1%}",
            f"{(total - t_sft) / 60:.1f}",
        )
    for role in sorted({k.split("/")[1] for k in summary if k.startswith("role/")}):
        table.add_row(
            f"  {role} (own reward), SFT -> RL",
            f"{summary[f'role/{role}/accuracy_after_sft']:.1%} -> "
            f"{summary[f'role/{role}/accuracy_after_rl_last3_mean']:.1%}",
            "",
        )
    for key in sorted(k for k in summary if k.startswith("by/") and k.endswith("_after_sft")):
        name = key.removeprefix("by/").removesuffix("/accuracy_after_sft")
        after = summary[key.replace("_after_sft", "_after_rl_last3_mean")]
        table.add_row(f"  {name}, SFT -> RL", f"{summary[key]:.1%} -> {after:.1%}", "")
    console.print(table)
    if calls:
        console.print(
            f"tool calls per episode: {summary['tool_calls_per_episode_first3']:.2f} (first 3 steps)"
            f" -> {summary['tool_calls_per_episode_last3']:.2f} (last 3 steps)"
        )
    console.print(
        f"total {total / 60:.1f} min; trained model: {result.model_dir}; metrics: {result.dir / 'metrics.jsonl'}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    try:
        from weir.telemetry.report import build_report

        console.print(f"report (curves, timeline, samples): {build_report(result.dir).html}")
    except Exception as err:  # the demo's result stands without its report
        console.print(f"[yellow]no report: {type(err).__name__}: {err}[/yellow]")
    return summary


def role_summary(evals: list[dict[str, float]]) -> dict[str, float]:
    """Multi-agent demos: each role's held-out accuracy (``eval/<role>/accuracy``) after SFT and
    after RL (mean of the last three evaluations)."""
    out: dict[str, float] = {}
    for key in evals[0]:
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "accuracy":
            name = f"role/{parts[1]}/accuracy"
            out[f"{name}_after_sft"], out[f"{name}_after_rl_last3_mean"] = _sft_and_rl(evals, key)
    return out


def breakdown_summary(evals: list[dict[str, float]]) -> dict[str, float]:
    """With `eval.breakdown` set: the accuracy per value of that row field
    (``eval/<field>/<value>/accuracy``) after SFT and after RL (mean of the last three evaluations),
    as ``by/<field>=<value>/accuracy_after_sft`` and ``..._after_rl_last3_mean``."""
    out: dict[str, float] = {}
    for key in evals[0]:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval" and parts[3] == "accuracy":
            name = f"by/{parts[1]}={parts[2]}/accuracy"
            out[f"{name}_after_sft"], out[f"{name}_after_rl_last3_mean"] = _sft_and_rl(evals, key)
    return out


def _sft_and_rl(evals: list[dict[str, float]], key: str) -> tuple[float, float]:
    """`key` after SFT (the first evaluation) and after RL (the mean of the last three evaluations
    that report it)."""
    last = [e[key] for e in evals if key in e][-3:]
    return evals[0][key], sum(last) / len(last)
