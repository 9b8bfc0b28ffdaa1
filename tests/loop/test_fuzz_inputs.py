"""Fuzzing what a user controls (config values and data rows): every case must end in a validation error
that names the problem, a counted skip, or a normal run; never a traceback from inside weir."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import weir
from weir.config import ConfigError
from weir.loop.run import RunError

# words a message must contain to count as an answer to the user (a key, the data, the fix)
HINTS = ("data", "row", "prompt", "rollout.", "train.", "run.", "reward", ".jsonl", "must", "set ")

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-3, 5),
)
config_values = st.fixed_dictionaries(
    {},
    optional={
        "train.lr": st.one_of(st.sampled_from([1e-4, 0.0, -1e-3]), numbers),
        "rollout.n": st.integers(-1, 4),
        "rollout.batch_prompts": st.integers(-1, 4),
        "train.mini_batches": st.integers(0, 3),
        "rollout.max_new_tokens": st.integers(-1, 5),
        "rollout.temperature": st.sampled_from([-1.0, 0.0, 0.7, 1.0, float("nan")]),
        "data.max_prompt_tokens": st.integers(-1, 40),
        "data.on_long_prompt": st.sampled_from(["skip", "truncate", "error", "explode"]),
        "run.checkpoint_every": st.integers(-1, 2),
        "train.grad_clip": st.sampled_from([None, 0.0, 1.0, -1.0]),
    },
)
valid_values = st.fixed_dictionaries(
    {},
    optional={
        "train.lr": st.sampled_from([1e-4, 1e-3]),
        "rollout.n": st.integers(1, 3),
        "rollout.max_new_tokens": st.integers(1, 4),
        "data.max_prompt_tokens": st.integers(1, 40),
        "data.on_long_prompt": st.sampled_from(["skip", "truncate", "error"]),
        "run.checkpoint_every": st.integers(0, 1),
    },
)
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "   ", "1+1=", "\x00", "é" * 30, "<|end|>", "12+" * 40]),
)
good_rows = st.fixed_dictionaries(
    {"prompt": st.sampled_from(["1+1=", "2+3=", "9+9=", "what is 4+4?"]), "answer": texts}
)
rows = st.one_of(
    good_rows,
    good_rows,
    st.fixed_dictionaries({"prompt": texts, "answer": st.one_of(texts, st.integers())}),
    st.fixed_dictionaries({"prompt": texts}),
    st.fixed_dictionaries({"question": texts, "answer": texts}),
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=2))}
    ),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "nobody"]), "content": texts}
                ),
                max_size=2,
            ),
            "answer": texts,
        }
    ),
)


def _write(path: Path, data: list[dict], raw_tail: bytes) -> None:
    with open(path, "wb") as f:
        for r in data:
            f.write(json.dumps(r).encode() + b"\n")
        f.write(raw_tail)


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    values=st.one_of(valid_values, config_values),
    data=st.lists(rows, min_size=1, max_size=6),
    raw_tail=st.one_of(
        st.just(b""), st.sampled_from([b"\n", b"{not json\n", b"\xff\xfe\n", b"[1, 2]\n"])
    ),
)
def test_user_input_ends_in_a_clear_answer_a_counted_skip_or_a_run(
    tmp_path_factory, values, data, raw_tail
):
    base = tmp_path_factory.getbasetemp() / "fuzz"
    base.mkdir(exist_ok=True)
    work = Path(tmp_path_factory.mktemp("case", numbered=True))
    rows_file = work / "rows.jsonl"
    _write(rows_file, data, raw_tail)
    cfg = {
        "run": {"steps": 1, "eval_every": 0, "save_model": False, "dir": str(base / work.name)},
        "model": {"path": "tiny:nano", "threads": 1},
        "data": {"task": None, "source": str(rows_file), "eval_source": str(rows_file)},
        "rollout": {"n": 2, "batch_prompts": 2, "max_new_tokens": 3},
        "reward": {"function": "exact_match"},
        "telemetry": {"console": False, "trace": False},
    }
    overrides = [f"{k}={v}" for k, v in values.items()]
    try:
        result = weir.run(cfg, overrides)
    except ConfigError as err:
        event("config error")
        assert any(k.split(".")[0] in str(err) for k in values) or "data" in str(err), str(err)
        return
    except (ValueError, RunError, FileNotFoundError) as err:  # what `weir train` prints as one line
        message = str(err)
        event(f"error: {re.sub(r'/[^ :]*', '<path>', message)[:200]}")
        assert any(h in message for h in HINTS), f"unhelpful message: {message!r}"
        return
    event("normal run")
    # a normal run: every prompt was used or counted as skipped, and the metrics are sane
    step = result.history[1] if len(result.history) > 1 else {}
    if "rollout/samples" in step:
        used = step["rollout/samples"] / 2
        skipped = step["data/skipped_bad_rows"] + step["rollout/skipped_long_prompts"]
        assert used + skipped + step.get("rollout/failed", 0) >= 1
        assert math.isfinite(step["reward/mean"]) or step["rollout/samples"] == 0
