from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weir.config import ConfigError, build_config, dump_config, load_config


def test_defaults_validate():
    cfg = build_config({})
    assert cfg.rollout.n == 8 and cfg.algo.advantage == "grpo"


def test_dotted_overrides_are_typed():
    cfg = build_config(
        {}, ["rollout.n=4", "train.lr=1e-4", "algo.kl.coef=0.01", "data.task_options={digits: 3}"]
    )
    assert cfg.rollout.n == 4
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.algo.kl.coef == pytest.approx(0.01)
    assert cfg.data.task_options == {"digits": 3}


def test_a_bare_off_is_the_word_off_not_false(tmp_path):
    """YAML 1.1 reads `off` as false; `train.fuse: off` (file or override) means the route "off"."""
    assert build_config({}, ["train.fuse=off"]).train.fuse == "off"
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  fuse: off\n")
    assert load_config(path).train.fuse == "off"
    with pytest.raises(ConfigError, match="train.fuse"):
        build_config({}, ["train.fuse=true"])


@pytest.mark.parametrize(
    ("override", "must_mention"),
    [
        ("rollout.nn=3", ["rollout.nn", "rollout.n"]),
        ("algo.kl.coeff=0.1", ["algo.kl.coeff", "algo.kl.coef"]),
        ("trian.lr=1", ["trian", "train"]),
    ],
)
def test_unknown_key_names_it_and_the_nearest(override, must_mention):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    for text in must_mention:
        assert text in str(err.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.n=0", "rollout.n"),
        ("train.lr=-1", "train.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
    ],
)
def test_bad_value_names_key_and_range(override, key):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    assert key in str(err.value)
    assert "greater than" in str(err.value) or "less than" in str(err.value)


def test_mini_batches_must_divide_batch():
    with pytest.raises(ConfigError, match="mini_batches"):
        build_config({}, ["rollout.batch_prompts=3", "rollout.n=3", "train.mini_batches=2"])


def test_override_without_equals_is_explained():
    with pytest.raises(ConfigError, match="key.path=value"):
        build_config({}, ["rollout.n"])


def test_yaml_round_trip(tmp_path):
    cfg = build_config({}, ["rollout.n=3", "run.name=x"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


@given(n=st.integers(-5, 5), lr=st.floats(-1, 1, allow_nan=False))
def test_values_validate_or_fail_with_named_key(n, lr):
    try:
        cfg = build_config(
            {},
            [
                f"rollout.n={n}",
                f"train.lr={lr!r}",
                "rollout.batch_prompts=4",
                "train.mini_batches=1",
            ],
        )
    except ConfigError as err:
        assert ("rollout.n" in str(err)) or ("train.lr" in str(err))
    else:
        assert cfg.rollout.n >= 1 and cfg.train.lr > 0


def test_user_data_needs_a_held_out_split():
    with pytest.raises(ConfigError, match="data.eval_source"):
        build_config({"data": {"task": None, "source": "train.jsonl"}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.correction.low=2", "algo.correction.high=1"], "algo.correction.low"),
        (["algo.kl.coef=0.1", "algo.kl.adaptive_target=0.01"], "algo.kl.as_reward"),
        (["algo.kl.as_reward=true"], "algo.kl.coef"),
        (["rollout.temperature=0", "rollout.n=4"], "rollout.temperature"),
        (["eval.n=4"], "eval.temperature"),
    ],
)
def test_combinations_that_cannot_work_are_rejected_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, overrides)


def test_a_renamed_key_in_an_old_run_config_moves_to_its_new_name():
    with pytest.warns(FutureWarning, match=r"engine.kv_cache_gb is now engine.kv_budget_gb"):
        cfg = build_config({"data": {"task": "arithmetic"}, "engine": {"kv_cache_gb": 2.0}})
    assert cfg.engine.kv_budget_gb == 2.0
