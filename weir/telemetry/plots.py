"""The report's charts: metric curves and the timeline Gantt chart, as plotly figures (for the
HTML page) and matplotlib PNGs (for a quick look, a slide, a bug report).

A panel lists the metrics it plots; metrics a run did not log are left out, and a panel with none
of its metrics is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from weir.telemetry.rundata import Span


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    """Metric names; a trailing `*` matches every metric with that prefix (`eval/pass@*`)."""
    unit: str = ""
    expected: bool = True
    """Whether the report notes it as missing when the run logged none of its metrics."""

    def series(
        self, steps: dict[int, dict[str, float]]
    ) -> dict[str, tuple[list[int], list[float]]]:
        """name -> (steps, values) for every metric of the panel the run logged (finite values)."""
        present = sorted({k for m in steps.values() for k in m})
        names: list[str] = []
        for key in self.keys:
            if key.endswith("*"):
                names += [k for k in present if k.startswith(key[:-1]) and k not in names]
            elif key in present and key not in names:
                names.append(key)
        out = {}
        for name in names:
            xs = [s for s, m in steps.items() if _finite(m.get(name))]
            if xs:
                out[name] = (xs, [steps[s][name] for s in xs])
        return out


PANELS = [
    Panel("Reward", ("reward/mean", "reward/std")),
    Panel("Eval score", ("eval/accuracy", "eval/reward", "eval/pass@*")),
    Panel(
        "Response length",
        ("response/length_mean", "response/length_max", "eval/response_length"),
        "tokens",
    ),
    Panel("Entropy", ("train/entropy",), "nats/token"),
    Panel("KL", ("kl/ref", "train/kl_ref", "policy/approx_kl", "kl/coef")),
    Panel(
        "Log-prob mismatch (trainer vs rollout engine)",
        ("mismatch/abs_logp_diff", "mismatch/kl", "correction/abs_logp_diff_mean"),
    ),
    Panel("Staleness", ("staleness/mean", "staleness/max"), "versions behind"),
    Panel("Throughput", ("throughput/*",), "tokens/s"),
    Panel(
        "Time per step",
        (
            "time/step",
            "time/generate",
            "time/wait_for_batch",
            "time/train",
            "time/sync",
            "eval/time",
        ),
        "s",
    ),
    Panel("Policy", ("policy/clipfrac_low", "policy/clipfrac_high", "train/grad_norm")),
    Panel("SFT loss", ("sft/loss",), expected=False),
]

# one colour per timeline phase, shared by the HTML and the PNG
PHASE_COLORS = {
    "generate": "#1f77b4",
    "decode": "#aec7e8",
    "reward": "#2ca02c",
    "train": "#d62728",
    "logprobs": "#ff9896",
    "forward": "#ff7f0e",
    "backward": "#9467bd",
    "optimizer": "#8c564b",
    "sync": "#e377c2",
    "wait": "#7f7f7f",
    "eval": "#17becf",
}
_OTHER = ["#bcbd22", "#ffbb78", "#98df8a", "#c5b0d5", "#dbdb8d"]


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def phase_color(name: str) -> str:
    return PHASE_COLORS.get(name, _OTHER[sum(map(ord, name)) % len(_OTHER)])


def lanes_of(spans: list[Span]) -> list[str]:
    """Lanes grouped by thread (threads in order of first appearance), each thread's own lane
    first, then its sub-lanes in order of first appearance."""
    threads: dict[str, list[str]] = {}
    for s in spans:
        lanes = threads.setdefault(s.lane.split(" / ")[0], [])
        if s.lane not in lanes:
            lanes.append(s.lane)
    return [
        lane
        for thread, lanes in threads.items()
        for lane in sorted(lanes, key=lambda x: x != thread)
    ]


# -- plotly (HTML) ------------------------------------------------------------------------------


def curve_figure(panel: Panel, series: dict[str, tuple[list[int], list[float]]]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, (xs, ys) in series.items():
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    fig.update_layout(
        title=panel.title,
        xaxis_title="step",
        yaxis_title=panel.unit or None,
        template="plotly_white",
        height=340,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def gantt_figure(spans: list[Span]):
    """Horizontal bars per lane (thread), one colour per phase; hover shows name and duration."""
    import plotly.graph_objects as go

    lanes = lanes_of(spans)
    fig = go.Figure()
    for name in dict.fromkeys(s.name for s in spans):
        mine = [s for s in spans if s.name == name]
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[s.lane for s in mine],
                x=[max(s.duration, 1e-6) for s in mine],
                base=[s.start for s in mine],
                name=name,
                marker_color=phase_color(name),
                hovertemplate=f"{name}<br>start %{{base:.3f}} s<br>%{{x:.4f}} s<extra></extra>",
            )
        )
    fig.update_layout(
        title="Timeline: where generation and training run, overlap and wait",
        barmode="overlay",
        xaxis_title="seconds since the run started",
        yaxis={"categoryorder": "array", "categoryarray": lanes[::-1]},
        template="plotly_white",
        height=140 + 40 * len(lanes),
        margin={"l": 200, "r": 20, "t": 50, "b": 40},
    )
    return fig


# -- matplotlib (PNG) ---------------------------------------------------------------------------


def curves_png(panels: list[tuple[Panel, dict]], path: Path) -> Path:
    """All curve panels in one grid, two columns."""
    from matplotlib.figure import Figure

    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(12, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels, strict=False):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        if panel.unit:
            ax.set_ylabel(panel.unit)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.savefig(path, dpi=100)
    return path


def timeline_png(spans: list[Span], path: Path) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = lanes_of(spans)
    fig = Figure(figsize=(14, 1.2 + 0.5 * len(lanes)), layout="constrained")
    ax = fig.subplots()
    for i, lane in enumerate(lanes):
        mine = [s for s in spans if s.lane == lane]
        ax.broken_barh(
            [(s.start, max(s.duration, 1e-6)) for s in mine],
            (len(lanes) - 1 - i - 0.4, 0.8),
            facecolors=[phase_color(s.name) for s in mine],
        )
    ax.set_yticks(range(len(lanes)), lanes[::-1])
    ax.set_xlabel("seconds since the run started")
    ax.set_title("Timeline")
    names = list(dict.fromkeys(s.name for s in spans))
    ax.legend(
        handles=[Patch(color=phase_color(n), label=n) for n in names],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.savefig(path, dpi=100)
    return path
