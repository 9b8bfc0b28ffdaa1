"""The KV capacity policy and budget arithmetic, checked against brute force and hand-worked values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Qwen2Config

from weir.config import ConfigError, load_config
from weir.engine.kv_budget import cell_bytes, plan_slabs, realloc_peak, resolve_budget


def simulate_realloc(live: int, old: int, new: int, tensors: int) -> int:
    """Allocate new tensor j, then free old tensor j, for every j; the most bytes alive."""
    o, n = old // tensors, new // tensors
    alive, peak = live, live
    for _ in range(tensors):
        alive += n
        peak = max(peak, alive)
        alive -= o
    return peak


@given(
    st.integers(0, 10**6),
    st.integers(1, 1000),
    st.integers(1, 1000),
    st.integers(1, 64),
)
def test_realloc_peak_equals_the_simulated_one(live, old_cells, new_cells, tensors):
    old, new = old_cells * tensors, new_cells * tensors
    assert realloc_peak(live + old, old, new, tensors) == simulate_realloc(
        live + old, old, new, tensors
    )


dims = st.integers(0, 40)


@given(
    need=st.tuples(st.integers(1, 40), st.integers(1, 80)),
    cap=st.tuples(dims, st.integers(0, 80)),
    other=st.integers(0, 5000),
    budget=st.one_of(st.none(), st.integers(0, 20000)),
    copy_old=st.booleans(),
)
def test_plan_fits_the_budget_covers_the_need_and_grows_at_most_twofold(
    need, cap, other, budget, copy_old
):
    (need_rows, need_cols), (cap_rows, cap_cols) = need, cap
    if not cap_rows or not cap_cols:
        cap_rows = cap_cols = 0
    cell, tensors = 2, 4
    old = cap_rows * cap_cols * cell
    plan = plan_slabs(
        need_rows=need_rows,
        need_cols=need_cols,
        cap_rows=cap_rows,
        cap_cols=cap_cols,
        max_rows=32,
        max_cols=64,
        live=other + old,
        old_bytes=old,
        cell=cell,
        tensors=tensors,
        budget=budget,
        copy_old=copy_old,
    )
    fits_now = need_rows <= cap_rows and need_cols <= cap_cols
    exact = need_rows * need_cols * cell
    if copy_old and old:
        exact_peak = simulate_realloc(other + old, old, exact, tensors)
    else:
        exact_peak = other + exact
    bound = 10**12 if budget is None else budget
    exact_ok = exact_peak <= bound and other + exact + exact // tensors <= bound
    if plan is None:
        assert budget is not None
        assert not exact_ok if not fits_now else other + old + old // tensors > budget
        return
    assert plan.rows >= need_rows and plan.cols >= need_cols
    if budget is not None:
        assert plan.peak <= budget
    if fits_now:
        assert not plan.realloc and (plan.rows, plan.cols) == (cap_rows, cap_cols)
        return
    assert plan.realloc
    assert plan.rows <= max(need_rows, min(2 * cap_rows, 32), cap_rows)
    assert plan.cols <= max(need_cols, min(2 * cap_cols, 64), cap_cols)
    if budget is None:  # unconstrained: the capacity that ran out doubles
        if need_cols > cap_cols and cap_cols:
            assert plan.cols >= min(2 * cap_cols, 64)
        if need_rows > cap_rows and cap_rows:
            assert plan.rows >= min(2 * cap_rows, 32)


def test_cell_bytes_of_a_qwen2_7b_shape():
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128: 2 * 28 * 4 * 128 * 2 bytes in bf16 = 57,344.
    cfg = Qwen2Config(
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584
    )
    assert cell_bytes(cfg, torch.bfloat16) == 57344
    assert cell_bytes(cfg, torch.float32) == 2 * 57344


def test_resolve_budget():
    cpu = torch.device("cpu")
    assert resolve_budget(None, None, cpu) is None
    assert resolve_budget(1.5, None, cpu) == 3 * 2**29
    free = resolve_budget(None, 1.0, cpu)
    assert resolve_budget(None, 0.25, cpu) == pytest.approx(free / 4, rel=0.1)
    with pytest.raises(ValueError, match="not both"):
        resolve_budget(1.0, 0.5, cpu)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        resolve_budget(None, 1.5, cpu)


def test_config_refuses_both_budget_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {task: arithmetic}\nengine: {kv_budget_gb: 1, kv_budget_fraction: 0.5}\n"
    )
    with pytest.raises(ConfigError, match="kv_budget_gb or engine.kv_budget_fraction"):
        load_config(path)
