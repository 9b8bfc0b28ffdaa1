"""multi_agent.policies=separate, the trainer side: each role's actor trains on its own views only,
with its own advantages and its own loss normaliser; the other policies are not touched."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tests.rollout.test_multi_agent_training import _episodes, _reference_grads
from weir import algo
from weir.config import build_config
from weir.train.actor import Actor, ActorSettings
from weir.train.batch import make_batch
from weir.train.role_trainer import RoleTrainer, aggregate, role_key, rows_by_role, select_rows

SETTINGS = [
    "rollout.batch_prompts=1",
    "rollout.n=2",
    "train.grad_clip=null",
    "algo.loss_agg=token-mean",
    "algo.old_logprobs=engine",
]


def _trainer(model_dir) -> RoleTrainer:
    settings = ActorSettings.from_config(build_config({}, SETTINGS))
    return RoleTrainer(
        {r: Actor(AutoModelForCausalLM.from_pretrained(model_dir), settings) for r in ("a", "b")}
    )


def _batch(trainer: RoleTrainer):
    """Two episodes of a, b, a (a's view holds b's turn as context), rewards a: (1, 0), b: (0, 1),
    with engine log-probs equal to each role's own policy's (as its engine would record)."""
    batch = make_batch(_episodes(), version=0)
    for role, rows in rows_by_role(batch, trainer.roles).items():
        sub = select_rows(batch, rows)
        actor = trainer.actors[role]
        lp = actor.logprobs(actor.model, sub) * sub.response_mask
        batch.rollout_logprobs[rows, : lp.shape[1]] = lp
    return batch


def _params(actor: Actor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def _grad(actor: Actor) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in actor.model.parameters()])


def test_a_batch_of_one_role_trains_that_policy_alone_with_its_own_gradient(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    full = _batch(trainer)
    only_a = select_rows(full, rows_by_role(full, ["a", "b"])["a"])
    assert {s.metadata["role"] for s in only_a.samples} == {"a"}
    a0, b0 = _params(trainer.actors["a"]), _params(trainer.actors["b"])

    stats = trainer.train(only_a)

    # policy b: not one bit changed, no gradient, no optimizer step
    assert all(
        torch.equal(p, q) for p, q in zip(b0, trainer.actors["b"].model.parameters(), strict=True)
    )
    assert all(p.grad is None for p in trainer.actors["b"].model.parameters())
    assert trainer.actors["b"].updates == 0 and trainer.actors["a"].updates == 1
    assert stats["train/a/samples"] == 2 and stats["train/b/samples"] == 0
    assert "train/b/loss" not in stats and stats["train/loss"] == stats["train/a/loss"]
    assert any(
        not torch.equal(p, q)
        for p, q in zip(a0, trainer.actors["a"].model.parameters(), strict=True)
    )
    # a's gradient: -(1/N_a) sum m A logp over a's two views, A = +-(1/2)/sqrt(1/2) by hand
    a_adv = torch.tensor([0.5, -0.5])[:, None] / (0.5**0.5 + 1e-6) * only_a.response_mask
    expected = _reference_grads(tiny_model_dir, only_a, a_adv, only_a.response_mask)
    got = _grad(trainer.actors["a"])
    assert got.abs().max() > 1e-4
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)


def test_in_a_mixed_batch_each_policy_sees_only_its_own_tokens(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    batch = _batch(trainer)
    rows = rows_by_role(batch, trainer.roles)
    assert rows == {"a": [0, 2], "b": [1, 3]}
    stats = trainer.train(batch)
    for role, sign in (("a", [1, -1]), ("b", [-1, 1])):
        sub = select_rows(batch, rows[role])
        adv = 0.5 * torch.tensor(sign, dtype=torch.float32)[:, None] / (0.5**0.5 + 1e-6)
        adv = adv * sub.response_mask
        # normalised by the role's own tokens (token-mean over its views), not the batch's
        expected = _reference_grads(tiny_model_dir, sub, adv, sub.response_mask)
        assert torch.allclose(_grad(trainer.actors[role]), expected, atol=1e-6, rtol=1e-4), role
        assert stats[f"train/{role}/samples"] == 2
    # the same batch on one shared policy gives another gradient than either role's
    shared = Actor(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), trainer.actors["a"].settings
    )
    pooled = _batch(trainer)  # log-probs of the (now updated) role policies: recompute for shared
    pooled.rollout_logprobs = shared.logprobs(shared.model, pooled) * pooled.response_mask
    shared.train(pooled)
    assert not torch.allclose(_grad(shared), _grad(trainer.actors["a"]), atol=1e-6, rtol=1e-3)


def test_select_rows_is_make_batch_of_those_samples():
    batch = make_batch(_episodes(), version=3)
    for rows in ([0, 2], [1, 3], [3]):
        sub = select_rows(batch, rows)
        alone = make_batch(
            [type(_episodes()[0])(samples=[batch.samples[i] for i in rows])], version=3
        )
        assert sub.samples == alone.samples
        for name in ("response_mask", "rollout_logprobs", "versions", "rewards"):
            assert torch.equal(getattr(sub, name), getattr(alone, name)), name
        # the grouping is the same partition (ids may be numbered differently)
        ids = sub.group_ids.tolist()
        assert [ids.index(x) for x in ids] == [
            alone.group_ids.tolist().index(x) for x in alone.group_ids.tolist()
        ]


def test_a_sample_of_no_known_role_is_refused():
    batch = make_batch(_episodes(), version=0)
    with pytest.raises(ValueError, match="role 'b' has no policy"):
        rows_by_role(batch, ["a"])


def test_state_round_trips_and_other_roles_are_refused(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    trainer.train(_batch(trainer))
    state = trainer.state_dict()
    fresh = _trainer(tiny_model_dir)
    fresh.load_state_dict(state)
    assert fresh.actors["a"].updates == 1 and fresh.actors["b"].updates == 1
    opt = fresh.actors["b"].optimizer.state_dict()["state"]
    assert opt and all(
        torch.equal(opt[k]["exp_avg"], state["roles"]["b"]["optimizer"]["state"][k]["exp_avg"])
        for k in opt
    )
    with pytest.raises(ValueError, match="was multi_agent.roles or multi_agent.policies changed"):
        fresh.load_state_dict({"roles": {"a": state["roles"]["a"]}})
    with pytest.raises(ValueError, match="multi_agent.roles or multi_agent.policies"):
        fresh.load_state_dict(trainer.actors["a"].state_dict())  # a shared policy's checkpoint


def test_weights_are_named_by_role(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    names = [n for n, _ in trainer.weights()]
    own = [n for n, _ in trainer.actors["a"].model.named_parameters()]
    assert names == [f"a/{n}" for n in own] + [f"b/{n}" for n in own]


def test_role_keys():
    assert role_key("train/loss", "judge") == "train/judge/loss"
    assert role_key("mismatch/abs_logp_diff", "a") == "mismatch/a/abs_logp_diff"


finite = st.floats(-10, 10, allow_nan=False)


@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]), st.tuples(finite, finite, finite), min_size=1
    ),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0.5, 100), min_size=3),
)
def test_aggregate_sums_times_and_weighs_means_by_tokens(values, tokens):
    per_role = {
        r: {
            "train/loss": loss,
            "time/train": abs(t) + 0.1,
            "policy/ratio_max": peak,
            "adv/adv_min": -peak,
            "adv/zero_std_groups": 2.0,
            "train/skipped_updates": 1.0,
            "throughput/train_tokens_per_s": 10.0 * (i + 1),
        }
        for i, (r, (loss, t, peak)) in enumerate(sorted(values.items()))
    }
    out = aggregate(per_role, tokens)
    n = sum(tokens[r] for r in per_role)
    assert math.isclose(
        out["train/loss"],
        sum(per_role[r]["train/loss"] * tokens[r] for r in per_role) / n,
        rel_tol=1e-9,
        abs_tol=1e-9,
    )
    total_time = sum(s["time/train"] for s in per_role.values())
    assert math.isclose(out["time/train"], total_time)
    assert out["policy/ratio_max"] == max(s["policy/ratio_max"] for s in per_role.values())
    assert out["adv/adv_min"] == min(s["adv/adv_min"] for s in per_role.values())
    assert out["train/skipped_updates"] == len(per_role)
    assert out["adv/zero_std_groups"] == 2.0 * len(per_role)
    tokens_per_s = sum(
        s["throughput/train_tokens_per_s"] * s["time/train"] for s in per_role.values()
    )
    assert math.isclose(out["throughput/train_tokens_per_s"], tokens_per_s / total_time)


def test_the_advantages_are_the_per_role_ones():
    """The per-role split keeps GRPO's (prompt, role) groups: a's advantages from a's rewards."""
    batch = make_batch(_episodes(), version=0)
    sub = select_rows(batch, [0, 2])
    adv = algo.compute_advantages("grpo", sub.rewards, sub.response_mask, sub.group_ids)
    m = sub.response_mask > 0
    assert torch.allclose(adv.advantages[0][m[0]], torch.tensor(0.5 / (0.5**0.5 + 1e-6)))
    assert torch.allclose(adv.advantages[1][m[1]], torch.tensor(-0.5 / (0.5**0.5 + 1e-6)))
