"""Resume choices, async resume, contained failures and clear answers to bad data (in process)."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

import weir
from weir.data.prompts import DataError
from weir.loop.run import RunError
from weir.train.checkpoint import list_checkpoints

BASE = {
    "run": {"steps": 4, "eval_every": 0, "checkpoint_every": 2, "save_model": False},
    "model": {"path": "tiny:nano", "threads": 1},
    "data": {"task": "arithmetic", "eval_size": 4},
    "rollout": {"n": 2, "batch_prompts": 3, "max_new_tokens": 3},
    "telemetry": {"console": False},
}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_choices(tmp_path, capsys):
    run_dir = tmp_path / "run"
    weir.run(BASE, [f"run.dir={run_dir}"])
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2, 4]

    # a corrupt newest checkpoint is reported and skipped; the run continues from the one before
    (run_dir / "checkpoints" / "step_00000004" / "trainer.pt").write_bytes(b"garbage")
    capsys.readouterr()
    result = weir.run(BASE, [f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_00000004: trainer.pt has 7 bytes" in err
    assert "resumed from" in err and "step_00000002" in err
    assert [r["step"] for r in _records(run_dir)] == [0, 1, 2, 3, 4]  # 3 and 4 written again
    assert len(result.history) == 5 and "eval/accuracy" in result.history[-1]

    # a finished run says so instead of silently doing nothing
    weir.run(BASE, [f"run.dir={run_dir}"])
    assert "already reached run.steps=4" in capsys.readouterr().err

    # changing the config is allowed but named
    weir.run(BASE, [f"run.dir={run_dir}", "run.steps=5", "train.lr=1e-4"])
    assert "changed config" in capsys.readouterr().err
    assert _records(run_dir)[-1]["step"] == 5

    # resume=never starts from scratch and throws the old checkpoints away
    weir.run(BASE, [f"run.dir={run_dir}", "run.resume=never", "run.checkpoint_every=0"])
    assert "resumed" not in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists()
    assert [r["step"] for r in _records(run_dir)][:2] == [0, 1]

    # an explicit checkpoint path that is not a checkpoint names the key
    with pytest.raises(FileNotFoundError, match="run.resume="):
        weir.run(BASE, [f"run.dir={run_dir}", f"run.resume={tmp_path / 'missing'}"])


def test_async_resume_keeps_buffered_groups_and_loses_no_prompt(tmp_path):
    cfg = {**BASE, "loop": {"mode": "async", "max_staleness": 1}}
    run_dir = tmp_path / "run"
    weir.run(cfg, [f"run.dir={run_dir}"])
    saved = torch.load(run_dir / "checkpoints" / "step_00000002" / "buffer.pt", weights_only=False)
    # every row drawn is accounted for: trained (2 steps x 3), waiting, dropped, or queued to regenerate
    waiting, requeued = len(saved["buffer"]["finished"]), len(saved["requeue"])
    dropped = saved["buffer"]["dropped"]
    assert saved["prompts"]["position"] == 2 * 3 + waiting + requeued + dropped
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    result = weir.run(cfg, [f"run.dir={run_dir}"])
    assert [r["step"] for r in _records(run_dir)] == [0, 1, 2, 3, 4]
    assert not result.stopped


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bad_rows_are_skipped_and_counted(tmp_path):
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    bad = [{"question": "no prompt field"}, {"prompt": "   "}, {"prompt": []}]
    _write_rows(
        tmp_path / "train.jsonl", [*good[0:2], bad[0], *good[2:4], bad[1], *good[4:], bad[2]]
    )
    _write_rows(tmp_path / "test.jsonl", good)
    cfg = {
        **BASE,
        "run": {**BASE["run"], "steps": 3, "checkpoint_every": 0},
        "data": {
            "task": None,
            "source": str(tmp_path / "train.jsonl"),
            "eval_source": str(tmp_path / "test.jsonl"),
            "shuffle": False,
        },
        "rollout": {**BASE["rollout"], "batch_prompts": 3},
        "reward": {"function": "exact_match"},
    }
    with pytest.warns(UserWarning, match="skipping a data row"):
        result = weir.run(cfg, [f"run.dir={tmp_path / 'run'}"])
    steps = [h for h in result.history if "data/skipped_bad_rows" in h]
    assert [h["data/skipped_bad_rows"] for h in steps] == [1.0, 1.0, 1.0]
    assert [h["rollout/samples"] for h in steps] == [4.0, 4.0, 4.0]  # 2 good rows x n=2 per step


def test_async_loop_skips_and_counts_bad_rows_too(tmp_path):
    good = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    rows = [*good[:3], {"prompt": ""}, *good[3:6], {"question": "?"}, *good[6:]]
    _write_rows(tmp_path / "train.jsonl", rows)
    cfg = {
        **BASE,
        "run": {**BASE["run"], "steps": 2, "checkpoint_every": 0},
        "data": {
            "task": None,
            "source": str(tmp_path / "train.jsonl"),
            "eval_source": str(tmp_path / "train.jsonl"),
            "shuffle": False,
            "epochs": 1,
        },
        "reward": {"function": "exact_match"},
        "loop": {"mode": "async", "max_staleness": 4},
    }
    with pytest.warns(UserWarning, match="skipping a data row"):
        result = weir.run(cfg, [f"run.dir={tmp_path / 'run'}"])
    assert sum(h.get("data/skipped_bad_rows", 0.0) for h in result.history) == 2.0
    assert sum(h.get("rollout/samples", 0.0) for h in result.history[1:] if "reward/mean" in h) > 0


def test_a_step_of_only_bad_rows_stops_with_the_fix(tmp_path):
    _write_rows(tmp_path / "train.jsonl", [{"text": "x"}] * 4)
    _write_rows(tmp_path / "test.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    cfg = {
        **BASE,
        "data": {
            "task": None,
            "source": str(tmp_path / "train.jsonl"),
            "eval_source": str(tmp_path / "test.jsonl"),
        },
        "reward": {"function": "exact_match"},
    }
    with pytest.raises(DataError, match="data.prompt_key"), pytest.warns(UserWarning):
        weir.run(cfg, [f"run.dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("policy", ["skip", "truncate", "error"])
def test_long_prompt_policies(tmp_path, policy):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+" * 80 + "1=", "answer": "81"}]
    _write_rows(tmp_path / "train.jsonl", rows)
    cfg = {
        **BASE,
        "run": {**BASE["run"], "steps": 1, "checkpoint_every": 0},
        "data": {
            "task": None,
            "source": str(tmp_path / "train.jsonl"),
            "eval_source": str(tmp_path / "train.jsonl"),
            "max_prompt_tokens": 40,
            "on_long_prompt": policy,
            "shuffle": False,
        },
        "rollout": {**BASE["rollout"], "batch_prompts": 2},
        "reward": {"function": "exact_match"},
    }
    if policy == "error":
        with pytest.raises(DataError, match="data.on_long_prompt"):
            weir.run(cfg, [f"run.dir={tmp_path / 'run'}"])
        return
    result = weir.run(cfg, [f"run.dir={tmp_path / 'run'}"])
    step = result.history[1]
    if policy == "skip":
        assert step["rollout/skipped_long_prompts"] == 1.0 and step["rollout/samples"] == 2.0
    else:
        assert step["data/truncated_prompts"] == 1.0 and step["rollout/samples"] == 4.0


def test_slow_and_raising_rewards_fail_their_samples_and_are_counted(tmp_path):
    calls = {"n": 0}

    def flaky(sample, row):
        calls["n"] += 1
        if calls["n"] % 4 == 1:
            raise RuntimeError("grader crashed")
        if calls["n"] % 4 == 2:
            time.sleep(6.0)  # hung far past reward.timeout_s
        return 1.0 if sample.index == 0 else 0.0

    cfg = {**BASE, "run": {**BASE["run"], "steps": 2, "checkpoint_every": 0}}
    cfg["reward"] = {"timeout_s": 0.3}
    cfg["rollout"] = {**BASE["rollout"], "max_failed_fraction": 0.9, "n": 4}
    result = weir.run(cfg, [f"run.dir={tmp_path / 'run'}"], reward=flaky)
    for h in result.history[1:3]:
        assert h["rollout/failed"] >= 2 and h["rollout/failed_frac"] < 0.9
        assert math.isfinite(h["train/loss"])
        assert h["time/generate"] < 4.0  # the step did not wait for the hung reward threads

    cfg["rollout"]["max_failed_fraction"] = 0.1
    calls["n"] = 0
    with pytest.raises(RunError) as err:
        weir.run(cfg, [f"run.dir={tmp_path / 'run2'}"], reward=flaky)
    assert "grader crashed" in str(err.value) and "max_failed_fraction" in str(err.value)


def test_nonfinite_gradient_skips_the_update_and_counts_it(tiny_model_dir):
    """An overflow in backward (here: an inf gradient injected by a hook) must not reach the weights."""
    from tests.toy import toy_groups
    from tests.train.test_actor import _actor
    from weir.train.batch import make_batch

    actor = _actor(tiny_model_dir)
    batch = make_batch(toy_groups(), version=0)
    batch.rollout_logprobs = actor.logprobs(actor.model, batch)
    param = actor.model.get_input_embeddings().weight
    hook = param.register_hook(lambda g: g * float("inf"))
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    stats = actor.train(batch)
    assert stats["train/skipped_updates"] == 1.0 and math.isnan(stats["train/grad_norm"])
    assert all(torch.equal(before[n], p) for n, p in actor.model.named_parameters())
    hook.remove()
    stats = actor.train(batch)  # the next, healthy update goes through
    assert stats["train/skipped_updates"] == 1.0 and math.isfinite(stats["train/grad_norm"])
    assert not all(torch.equal(before[n], p) for n, p in actor.model.named_parameters())


def first_sample_reward(sample, row):
    return 1.0 if sample.index == 0 else 0.0


def test_resumed_tensorboard_shows_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cfg = {**BASE, "telemetry": {"console": False, "tensorboard": True}}
    weir.run(cfg, [f"run.dir={run_dir}"])
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    result = weir.run(cfg, [f"run.dir={run_dir}"])  # resumes at step 2: steps 3 and 4 again
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rewards = acc.Scalars("reward/mean")
    assert [e.step for e in rewards] == [1, 2, 3, 4]
    assert rewards[-1].value == pytest.approx(result.history[-1]["reward/mean"], abs=1e-6)
