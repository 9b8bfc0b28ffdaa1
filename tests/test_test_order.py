"""The suite's order on `make test`'s two workers: the longest files first (tests/conftest.py,
tests/durations.json), so that neither worker is left alone with a long file at the end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_the_longest_files_go_first_and_a_files_tests_keep_their_order(tmp_path, monkeypatch):
    timed = tmp_path / "durations.json"
    timed.write_text(json.dumps({"tests/c.py": 50, "tests/b.py": 10}))
    monkeypatch.setattr(conftest, "DURATIONS", timed)
    ids = ["tests/a.py::one", "tests/b.py::x", "tests/a.py::two", "tests/c.py::y", "tests/d.py::z"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/c.py::y",
        "tests/b.py::x",
        "tests/a.py::one",  # untimed files: as collected
        "tests/a.py::two",
        "tests/d.py::z",
    ]


def test_every_timed_file_exists():
    timed = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert timed, "tests/durations.json is empty: run scripts/test_durations.py"
    missing = [path for path in timed if not (ROOT / path).is_file()]
    assert not missing, f"tests/durations.json names files that are gone: {missing}"
