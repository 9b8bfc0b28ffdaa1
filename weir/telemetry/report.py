"""`weir report RUN_DIR`: one self-contained HTML page (plotly, its JavaScript inlined, so it opens
offline) and PNGs beside it, from what the run directory holds:

- curves of the step metrics (metrics.jsonl, merged with timings.jsonl when a deterministic run
  wrote its wall-clock metrics there): reward, eval score, response length, entropy, KL, log-prob
  mismatch, staleness, throughput, time per step;
- a Gantt chart of trace.json: one lane per thread, one colour per phase, with how long generation
  and training overlapped and how long the trainer waited;
- the best and the worst sample of each step by reward, from the rollout dumps
  (telemetry.dump_rollouts), with the prompt's images beside the response (embedded as data URLs,
  so the page stays self-contained).

What a run did not record is skipped, and the page says so.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import time
from dataclasses import dataclass, field
from pathlib import Path

from weir.telemetry import plots
from weir.telemetry.rundata import (
    Span,
    load_metrics,
    load_rollouts,
    load_spans,
    overlap,
    total,
)

MAX_SAMPLE_STEPS = 30
MAX_TEXT = 500


@dataclass
class Report:
    html: Path
    pngs: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    """Parts left out because the run did not record them, each with the reason."""


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write report.html, curves.png and timeline.png to `out_dir` (default: <run_dir>/report)."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    start = time.perf_counter()
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(
            f"{run_dir} has no metrics.jsonl: pass a run directory (the run.dir of a training run)"
        )
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(html=out / "report.html")

    steps = load_metrics(run_dir)
    panels = [(p, s) for p in plots.PANELS if (s := p.series(steps))]
    report.skipped += [
        f"{p.title}: not logged by this run"
        for p in plots.PANELS
        if p.expected and not p.series(steps)
    ]
    sections = [_summary(run_dir, steps)]
    divs = []
    for i, (panel, series) in enumerate(panels):
        fig = plots.curve_figure(panel, series)
        divs.append(_figure_html(pio, fig, f"curve-{i}"))
    sections.append(_section("Metrics", f'<div class="grid">{"".join(divs)}</div>'))
    if panels:
        report.pngs.append(plots.curves_png(panels, out / "curves.png"))

    trace = run_dir / "trace.json"
    spans = load_spans(trace) if trace.exists() else []
    if spans:
        body = _timeline_table(spans) + _figure_html(
            pio, plots.gantt_figure(spans), "timeline", full_width=True
        )
        report.pngs.append(plots.timeline_png(spans, out / "timeline.png"))
    else:
        why = (
            "the run wrote no trace.json (telemetry.trace=false)"
            if not trace.exists()
            else "trace.json has no spans"
        )
        report.skipped.append(f"Timeline: {why}")
        body = f"<p class='note'>No timeline: {why}.</p>"
    sections.append(_section("Timeline", body))

    rollouts = load_rollouts(run_dir)
    if rollouts is None:
        report.skipped.append("Samples: rollout dumps are off (telemetry.dump_rollouts=false)")
        body = (
            "<p class='note'>Rollout dumps are off for this run: train with "
            "<code>telemetry.dump_rollouts=true</code> to see sample responses here.</p>"
        )
    else:
        body = _samples_table(rollouts)
    sections.append(_section("Samples: best and worst response of each step by reward", body))

    config = run_dir / "config.yaml"
    if config.exists():
        sections.append(
            _section(
                "Config",
                f"<details><summary>config.yaml</summary><pre>{html.escape(config.read_text())}</pre></details>",
            )
        )
    if report.skipped:
        items = "".join(f"<li>{html.escape(s)}</li>" for s in report.skipped)
        sections.append(_section("Not in this report", f"<ul>{items}</ul>"))

    page = _PAGE.format(
        title=html.escape(f"weir report: {run_dir.name}"),
        plotly=get_plotlyjs(),
        css=_CSS,
        body="\n".join(sections),
    )
    report.html.write_text(page, encoding="utf-8")
    report.seconds = time.perf_counter() - start
    return report


def _figure_html(pio, fig, div_id: str, full_width: bool = False) -> str:
    inner = pio.to_html(
        fig,
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        default_height=f"{fig.layout.height or 340}px",
        config={"displaylogo": False, "responsive": True},
    )
    cls = "figure wide" if full_width else "figure"
    return f'<div class="{cls}">{inner}</div>'


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{body}</section>"


def _table(header: list[str] | None, rows: list[list[str]], cls: str = "") -> str:
    """An HTML table; cells are HTML already (escape text before)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header or [])
    thead = f"<thead><tr>{head}</tr></thead>" if head else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">{thead}<tbody>{body}</tbody></table>'


def _fmt(v: float | None) -> str:
    if v is None or v != v:
        return "–"
    return f"{v:.4g}"


def _summary(run_dir: Path, steps: dict[int, dict[str, float]]) -> str:
    trained = [
        s for s, m in steps.items() if "reward/mean" in m or "train/loss" in m or "sft/loss" in m
    ]
    last = steps[max(steps)] if steps else {}
    evals = [(s, m) for s, m in steps.items() if "eval/accuracy" in m]
    wall = sum(
        m.get("time/step", 0.0) for m in steps.values() if m.get("time/step") == m.get("time/step")
    )
    rows = [
        ["run directory", html.escape(str(run_dir.resolve()))],
        ["steps logged", f"{len(trained)} (last step {max(steps) if steps else '–'})"],
        [
            "final reward (mean)",
            _fmt(
                next(
                    (m["reward/mean"] for _, m in reversed(steps.items()) if "reward/mean" in m),
                    None,
                )
            ),
        ],
        [
            "first / last eval accuracy",
            f"{_fmt(evals[0][1]['eval/accuracy'])} / {_fmt(evals[-1][1]['eval/accuracy'])}"
            if evals
            else "–",
        ],
        ["wall time of the logged steps", f"{wall:.1f} s" if wall else "–"],
        ["weight version at the end", _fmt(last.get("version"))],
        ["mismatch correction the run needs", html.escape(mismatch_line(steps))],
    ]
    return _section(f"Run {run_dir.name}", _table(None, rows, "summary"))


# the presets `weir.algo.recommend_preset` may name, in the order of `mismatch/recommended`
RECOMMENDABLE = ("none", "tis", "seq_mis", "icepop")


def mismatch_line(steps: dict[int, dict[str, float]]) -> str:
    """One line on the engine/trainer ratios of the run (`mismatch/*` of `weir.algo`'s
    `mismatch_diagnostics`): the preset the last steps need and the spread behind it."""
    seen = [m for _, m in sorted(steps.items()) if "mismatch/recommended" in m]
    if not seen:
        return "– (no step measured the engine/trainer ratios)"
    last = seen[-5:]
    votes = [RECOMMENDABLE[int(m["mismatch/recommended"])] for m in last]
    pick = max(set(votes), key=votes.count)
    m = last[-1]
    return (
        f"{pick} (the last {len(last)} steps: {', '.join(votes)}); token ratio 1%-99% "
        f"{m['mismatch/token_ratio_q01']:.4g}-{m['mismatch/token_ratio_q99']:.4g}, "
        f"{100 * m['mismatch/outside/token_mask']:.3g}% of tokens and "
        f"{100 * m['mismatch/outside/seq_mask']:.3g}% of sequences outside [0.5, 2]; "
        "algo.correction.preset sets it (docs/algorithms.md)"
    )


def _timeline_table(spans: list[Span]) -> str:
    """Per lane: busy seconds and share of the traced wall time; then overlap and waiting."""
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    wall = max(t1 - t0, 1e-9)
    rows = []
    for lane in plots.lanes_of(spans):
        mine = [s for s in spans if s.lane == lane]
        busy = total([(s.start, s.end) for s in mine])
        phases = ", ".join(dict.fromkeys(s.name for s in mine))
        rows.append([html.escape(lane), html.escape(phases), f"{busy:.2f} s", f"{busy / wall:.0%}"])

    def of(name: str) -> list[tuple[float, float]]:
        return [(s.start, s.end) for s in spans if s.name == name]

    gen, decode, train = of("generate"), of("decode"), of("train")
    facts = [
        f"traced wall time {wall:.2f} s",
        f"rollouts in flight {total(gen):.2f} s",
        f"training {total(train):.2f} s",
        f"rollouts and training overlapped {overlap(gen, train):.2f} s",
    ]
    if decode:
        facts.append(
            f"the engine computed {total(decode):.2f} s ({total(decode) / wall:.0%}), "
            f"{overlap(decode, train):.2f} s of it while the trainer trained"
        )
    for thread in dict.fromkeys(s.lane.split(" / ")[0] for s in spans):
        waits = [(s.start, s.end) for s in spans if s.name == "wait" and s.lane.startswith(thread)]
        if waits:
            facts.append(f"{thread} waited {total(waits):.2f} s ({total(waits) / wall:.0%})")
    return f"<p>{html.escape('; '.join(facts))}.</p>" + _table(
        ["lane", "phases", "busy", "share of wall time"], rows, "lanes"
    )


def _clip(text: str) -> str:
    text = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + " …"
    return f"<pre>{html.escape(text)}</pre>"


def _image_src(ref: str) -> str | None:
    """A data URL for an image reference of a rollout dump: itself, or a local file read in (None
    for a remote URL or a missing file: the page must open offline)."""
    if ref.startswith("data:image/"):
        return ref
    path = Path(ref).expanduser()
    if ref.startswith(("http://", "https://")) or not path.is_file():
        return None
    kind = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _images(refs: list[str]) -> str:
    cells = []
    for ref in refs:
        src = _image_src(str(ref))
        if src is None:
            cells.append(f"<code>{html.escape(str(ref)[:80])}</code>")
        else:
            cells.append(
                f'<img class="thumb" src="{html.escape(src, quote=True)}" alt="prompt image">'
            )
    return "".join(cells)


def _samples_table(rollouts: dict[int, list[dict]]) -> str:
    chosen = sorted(rollouts)
    note = ""
    if len(chosen) > MAX_SAMPLE_STEPS:
        stride = (len(chosen) - 1) / (MAX_SAMPLE_STEPS - 1)
        chosen = sorted({chosen[round(i * stride)] for i in range(MAX_SAMPLE_STEPS)})
        note = f"<p class='note'>{len(chosen)} of {len(rollouts)} dumped steps, evenly spaced.</p>"
    rows = []
    with_images = any(r.get("images") for step in chosen for r in rollouts[step])
    for step in chosen:
        scored = [r for r in rollouts[step] if isinstance(r.get("reward"), int | float)]
        if not scored:
            continue
        mean = sum(r["reward"] for r in scored) / len(scored)
        best = max(scored, key=lambda r: r["reward"])  # the first of equals, in dump order
        worst = min(scored, key=lambda r: r["reward"])
        picks = [("best", best)] + ([("worst", worst)] if len(scored) > 1 else [])
        for which, r in picks:
            prompt = r.get("prompt_text") or str((r.get("row") or {}).get("prompt", ""))
            cells = [
                str(step),
                which,
                f"{r['reward']:.4g}",
                f"{mean:.3g}",
                str(len(r.get("response_ids", []))),
                html.escape(str(r.get("status", ""))),
                _clip(prompt),
            ]
            if with_images:
                cells.append(_images(r.get("images") or []))
            rows.append([*cells, _clip(r.get("response_text") or "")])
    header = ["step", "", "reward", "step mean", "tokens", "status", "prompt"]
    header += ["image", "response"] if with_images else ["response"]
    return note + _table(header, rows, "samples")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.figure { border: 1px solid #eee; border-radius: 4px; }
table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 4px 8px; vertical-align: top; text-align: left; }
table.samples img.thumb { width: 96px; height: 96px; object-fit: contain;
  image-rendering: pixelated; margin-right: 4px; border: 1px solid #ccc; }
table.samples pre { margin: 0; white-space: pre-wrap; max-width: 560px; font-size: 0.95em; }
.note { color: #666; font-style: italic; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{css}</style>
<script type="text/javascript">{plotly}</script>
</head>
<body>
<h1>{title}</h1>
{body}
<script>
// plots drawn before the grid settled take the width of their column once the page has loaded
window.addEventListener("load", function () {{
  document.querySelectorAll(".plotly-graph-div").forEach(function (d) {{ Plotly.Plots.resize(d); }});
}});
</script>
</body>
</html>
"""
