"""`weir report RUN_DIR`: one self-contained HTML page and PNGs, rendered for real in Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from weir.cli.main import app
from weir.telemetry.report import build_report
from weir.telemetry.rundata import load_metrics, load_rollouts

CURVES = [
    "Reward",
    "Eval score",
    "Response length",
    "Entropy",
    "KL",
    "Log-prob mismatch",
    "Staleness",
    "Throughput",
]


def figure_ids(page: str) -> list[str]:
    return re.findall(r'<div id="([\w-]+)" class="plotly-graph-div"', page)


def test_report_has_every_curve_the_timeline_and_samples(sync_run, tmp_path):
    report = build_report(sync_run.dir, tmp_path / "out")
    page = report.html.read_text()
    assert "<script src=" not in page  # plotly is inlined: the page opens offline
    assert "Plotly.newPlot" in page and len(page) > 1_000_000
    for title in CURVES:
        assert f'"text":"{title}' in page, title
    assert "timeline" in figure_ids(page)
    assert "Rollout dumps are off" not in page
    # the best and the worst sample of the last step, with their rewards
    last = max(load_rollouts(sync_run.dir))
    rewards = [r["reward"] for r in load_rollouts(sync_run.dir)[last]]
    dumped = load_rollouts(sync_run.dir)[last]
    best = max(dumped, key=lambda r: r["reward"])  # first of the best, as the report picks
    shown = best["prompt_text"] or best["row"]["prompt"]  # the dataset row when no prompt text
    cells = f"<pre>{html.escape(shown)}</pre></td><td><pre>{html.escape(best['response_text'])}"
    assert cells in page
    rows = re.findall(rf"<tr><td>{last}</td><td>(best|worst)</td><td>([^<]+)</td>", page)
    assert rows[0] == ("best", f"{max(rewards):.4g}")
    if len(rows) > 1:
        assert rows[1] == ("worst", f"{min(rewards):.4g}")
    assert {p.name for p in report.pngs} == {"curves.png", "timeline.png"}
    for png in report.pngs:
        image = plt_image(png)
        assert image.shape[0] > 200 and image.std() > 0.05  # drawn, not blank
    assert report.skipped == []


def plt_image(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    return imread(path)[..., :3]


def test_report_of_a_run_without_dumps_or_trace_says_so(sync_run, tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    shutil.copy(sync_run.dir / "metrics.jsonl", run)
    report = build_report(run)
    page = report.html.read_text()
    assert report.html == run / "report" / "report.html"
    assert "Rollout dumps are off" in page and "telemetry.dump_rollouts=true" in page
    assert "No timeline" in page and "timeline" not in figure_ids(page)
    assert any(s.startswith("Samples") for s in report.skipped)
    assert [p.name for p in report.pngs] == ["curves.png"]


def test_timings_jsonl_is_merged_by_step(tmp_path):
    """Deterministic runs write wall-clock metrics to timings.jsonl beside metrics.jsonl."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.75, "train/entropy": null}\n'
    )
    (tmp_path / "timings.jsonl").write_text(
        '{"step": 1, "time/step": 2.0, "throughput/gen_tokens_per_s": 100.0}\n'
        '{"step": 2, "time/step": 3.0, "throughput/gen_tokens_per_s": 120.0}\n'
    )
    steps = load_metrics(tmp_path)
    assert steps[1] == {"reward/mean": 0.5, "time/step": 2.0, "throughput/gen_tokens_per_s": 100.0}
    assert steps[2]["time/step"] == 3.0 and np.isnan(steps[2]["train/entropy"])
    page = build_report(tmp_path).html.read_text()
    assert '"text":"Throughput"' in page and '"text":"Reward"' in page
    assert '"text":"Staleness"' not in page  # not logged: skipped, and listed as skipped
    assert "Staleness: not logged by this run" in page


def test_report_of_a_directory_without_metrics_is_a_user_error(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert "no metrics.jsonl" in " ".join(result.output.split())


def test_cli_writes_the_report(async_run, tmp_path):
    result = CliRunner().invoke(app, ["report", str(async_run.dir), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").exists() and (tmp_path / "timeline.png").exists()
    assert "report.html" in result.output


# -- headless Chromium ----------------------------------------------------------------------------

# collects uncaught errors and console.error calls; after load, writes them into the DOM
ERROR_COLLECTOR = """<script>
window.__errors = [];
window.addEventListener("error", function (e) { window.__errors.push("error: " + e.message); });
(function () {
  var orig = console.error;
  console.error = function () {
    window.__errors.push("console.error: " + Array.prototype.join.call(arguments, " "));
    orig.apply(console, arguments);
  };
})();
window.addEventListener("load", function () {
  setTimeout(function () {
    var pre = document.createElement("pre");
    pre.id = "collected-errors";
    pre.textContent = JSON.stringify(window.__errors);
    document.body.appendChild(pre);
  }, 500);
});
</script>"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # tests may run as root (CI containers)
            "--disable-gpu",
            "--disable-dev-shm-usage",  # small /dev/shm in containers
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


def colour_share(image: np.ndarray, hex_colour: str, tol: float = 0.04) -> float:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return float((np.abs(image - rgb).max(axis=-1) < tol).mean())


@pytest.mark.slow
def test_report_renders_in_headless_chromium(async_run, tmp_path):
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no chromium on PATH (scripts/setup.sh installs Debian's `chromium` when apt is there)"
        )
    report = build_report(async_run.dir, tmp_path / "report")
    page = report.html.read_text()
    instrumented = tmp_path / "report" / "instrumented.html"
    instrumented.write_text(page.replace("<head>", "<head>\n" + ERROR_COLLECTOR, 1))
    url = instrumented.as_uri()

    dom = chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    errors = re.search(r'<pre id="collected-errors">(.*?)</pre>', html)
    assert errors, "the page's scripts did not finish"
    assert json.loads(errors.group(1).replace("&quot;", '"')) == []
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    ids = figure_ids(page)
    assert len(ids) >= len(CURVES) + 1
    for div_id in ids:  # every plotly div was drawn: it now holds the svg plotly renders
        start = html.index(f'id="{div_id}"')
        following = html[start : start + 20_000]
        assert 'class="main-svg"' in following, div_id
    assert html.count('class="main-svg"') >= len(ids)
    assert len(re.findall(r'class="point"', html)) > 10  # markers of the curves
    assert html.count('class="point"') + html.count("<path") > 50

    shot = tmp_path / "shot.png"
    run = chromium(
        binary, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1400,4000", url
    )
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    image = plt_image(shot)
    assert image.std() > 0.05  # not a blank page
    assert colour_share(image, "#636efa") > 1e-4  # plotly's first trace colour: curves are drawn
    assert colour_share(image, "#d62728") > 1e-4  # the timeline's train bars
    assert colour_share(image, "#1f77b4") > 1e-4  # the timeline's generate bars
