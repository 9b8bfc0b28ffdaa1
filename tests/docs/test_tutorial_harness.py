"""The harness that runs the docs' commands reads markers, files and commands as the pages mean
them, and fails where a page has drifted (a renamed key, a missing script)."""

from __future__ import annotations

import pytest

from tests.docs.test_tutorials import _check
from tests.docs.tutorials import blocks, commands, scaled

PAGE = """# A page

<!-- docs-test: run -->
```bash
weir train examples/arithmetic_quick.yaml run.steps=7 \\
  rollout.n=2     # a comment
weir eval runs/x
```

```python title="my_rewards.py"
def score(sample, row): return 1.0
```

```bash
weir demo
```

<!-- docs-test: skip needs a GPU -->

Some text between the marker and the block.

```bash
weir train x.yaml
```
"""


def test_blocks_markers_and_files(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = blocks(page)
    assert [(b.kind, b.mode) for b in found] == [
        ("bash", "run"),
        ("file", ""),
        ("bash", ""),  # no marker: the page test reports it
        ("bash", ""),  # the marker is not right before the block
    ]
    assert found[1].path == "my_rewards.py" and "def score" in found[1].text
    assert commands(found[0].text) == [
        ["weir", "train", "examples/arithmetic_quick.yaml", "run.steps=7", "rollout.n=2"],
        ["weir", "eval", "runs/x"],
    ]


def test_scaling_keeps_what_the_page_sets():
    argv = scaled(["weir", "train", "c.yaml", "run.steps=7"])
    assert "run.steps=7" in argv and "run.steps=2" not in argv
    assert "rollout.n=4" in argv and "telemetry.console=false" in argv
    assert scaled(["weir", "eval", "m"])[-2:] == ["--size", "8"]
    assert scaled(["weir", "export", "r", "--out", "o"]) == ["weir", "export", "r", "--out", "o"]


def test_config_checks_fail_on_drift():
    _check(["weir", "train", "examples/arithmetic.yaml", "rollout.n=3"])
    with pytest.raises(AssertionError, match="rollout.nn"):
        _check(["weir", "train", "examples/arithmetic.yaml", "rollout.nn=3"])
    with pytest.raises(AssertionError, match="no such Makefile target"):
        _check(["make", "setup-everything"])
    with pytest.raises(AssertionError, match="not there"):
        _check(["scripts/no_such_script.sh"])
    with pytest.raises(AssertionError, match="no extra"):
        _check(["pip", "install", "weir[no-such-extra]"])
