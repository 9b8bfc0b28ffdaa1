"""Write tests/durations.json, the seconds each test file took, from a pytest JUnit XML report.

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/run.xml
    .venv/bin/python scripts/test_durations.py /tmp/run.xml

tests/conftest.py runs the longest files first with it (`make test`'s two workers then finish
together). Files under `--min-s` seconds are left out: their order does not matter.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_file(classname: str) -> str | None:
    """`tests.train.test_x.TestY` -> `tests/train/test_x.py` (the longest prefix that is a file)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
    return None


def durations(report: Path) -> dict[str, float]:
    """Seconds per test file: every test case's time (set-up, call and tear-down) summed."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        path = test_file(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return dict(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="pytest --junitxml output")
    ap.add_argument("--min-s", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "durations.json")
    args = ap.parse_args()
    found = durations(args.report)
    kept = {k: round(v) for k, v in sorted(found.items(), key=lambda kv: -kv[1]) if v >= args.min_s}
    args.out.write_text(json.dumps(kept, indent=1) + "\n")
    total = sum(found.values())
    print(f"{len(kept)} of {len(found)} files (>= {args.min_s:g} s), {total:.0f} s in all")


if __name__ == "__main__":
    main()
