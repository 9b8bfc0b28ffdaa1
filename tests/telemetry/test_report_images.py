"""The report's samples table shows each prompt's images beside the response, embedded so that the
page opens offline."""

from __future__ import annotations

import base64
import io
import json
import re

from PIL import Image

from weir.data.sample import Group, Sample
from weir.data.vision import VisionInputs
from weir.telemetry.report import build_report
from weir.telemetry.rollouts import dump_rollouts


def _png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_samples_table_embeds_the_prompt_images(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.5 * s}) + "\n" for s in (1, 2))
    )
    inline = "data:image/png;base64," + base64.b64encode(_png((255, 0, 0))).decode()
    on_disk = tmp_path / "blue.png"
    on_disk.write_bytes(_png((0, 0, 255)))
    vision = VisionInputs({"pixel_values": [[0.0]]}, [inline, str(on_disk), "https://x.org/a.png"])
    samples = [
        Sample(
            prompt_ids=[1], response_ids=[2], reward=r, vision=vision, response_text=f"answer {r}"
        )
        for r in (1.0, 0.0)
    ]
    dump_rollouts(run / "rollouts" / "step_2.jsonl", 2, [Group(samples)])
    page = build_report(run).html.read_text()
    srcs = re.findall(r'<img class="thumb" src="([^"]+)"', page)
    from_file = "data:image/png;base64," + base64.b64encode(on_disk.read_bytes()).decode()
    assert srcs == [inline, from_file] * 2  # best and worst row, each with both images
    assert "<code>https://x.org/a.png</code>" in page  # a remote image is named, never fetched
    assert "<th>image</th>" in page and "answer 1.0" in page


def test_text_runs_have_no_image_column(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 1.0}) + "\n")
    dump_rollouts(run / "rollouts" / "step_1.jsonl", 1, [Group([Sample([1], [2], reward=1.0)])])
    page = build_report(run).html.read_text()
    assert "<th>image</th>" not in page and "<th>response</th>" in page
