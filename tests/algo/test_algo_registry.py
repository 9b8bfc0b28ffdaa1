"""Registries and user functions plugged in by dotted path."""

from __future__ import annotations

import pytest
import torch

from weir.algo import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageResult,
    compute_advantages,
    compute_policy_loss,
    resolve,
)
from weir.algo.registry import Registry


def my_advantage(rewards, mask, group_ids, *, scale: float = 1.0):
    """A user estimator: A = scale * r on every trained token."""
    return AdvantageResult((scale * rewards).unsqueeze(1) * mask, None, {"my_metric": 42.0})


def my_loss(logp, old_logp, advantages, mask, *, coef: float = 1.0):
    """A user loss: l = -coef * A * logp."""
    return -coef * advantages * logp, {"my_loss_metric": torch.tensor(1.5)}


def my_kwargs_loss(logp, old_logp, advantages, mask, **options):
    return -advantages * logp, {"n_options": float(len(options))}


class Namespace:
    @staticmethod
    def tuple_advantage(rewards, mask, group_ids):
        adv = rewards.unsqueeze(1) * mask
        return adv, adv + 1


MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize("sep", [":", "."])
def test_user_advantage_by_dotted_path(sep):
    res = compute_advantages(
        f"{__name__}{sep}my_advantage",
        torch.tensor([2.0, -1.0]),
        MASK,
        torch.tensor([0, 0]),
        scale=0.5,
    )
    torch.testing.assert_close(res.advantages, torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]]))
    assert res.metrics["my_metric"] == 42.0
    assert res.mask.dtype == torch.bool


def test_user_advantage_nested_attribute_and_tuple_result():
    res = compute_advantages(
        f"{__name__}:Namespace.tuple_advantage",
        torch.tensor([2.0, 1.0]),
        MASK,
        torch.tensor([0, 1]),
    )
    torch.testing.assert_close(res.returns, torch.tensor([[3.0, 3.0, 0.0], [2.0, 2.0, 2.0]]))


def test_user_loss_by_dotted_path_and_callable():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    adv = torch.ones(2, 3)
    kw = dict(agg="token-mean", num_tokens=5, num_seqs=2)
    # -(-1 -2) - (-1 -1 -1) = 6 ; * coef 2 / 5 = 2.4
    loss, m = compute_policy_loss(f"{__name__}:my_loss", logp, None, adv, MASK, coef=2.0, **kw)
    assert loss.item() == pytest.approx(2.4)
    assert m["my_loss_metric"] == 1.5
    loss2, _ = compute_policy_loss(my_loss, logp, None, adv, MASK, coef=2.0, **kw)
    assert loss2.item() == loss.item()
    with pytest.raises(ValueError, match="does not take the option 'cofe'.*did you mean 'coef'"):
        compute_policy_loss(my_loss, logp, None, adv, MASK, cofe=2.0, **kw)
    _, m3 = compute_policy_loss(my_kwargs_loss, logp, None, adv, MASK, a=1, b=2, **kw)
    assert m3["n_options"] == 2.0


def test_resolve_registered_and_dotted():
    assert resolve("grpo", ADVANTAGES) is ADVANTAGES["grpo"]
    assert resolve("weir.algo.advantages:grpo", ADVANTAGES) is ADVANTAGES["grpo"]
    assert resolve("weir.algo.policy_loss.ppo") is POLICY_LOSSES["ppo"]
    assert resolve(my_loss) is my_loss


def test_resolve_unknown_name_lists_valid_and_nearest():
    with pytest.raises(ValueError) as e:
        resolve("rlooo", ADVANTAGES)
    msg = str(e.value)
    assert "unknown advantage estimator 'rlooo'" in msg
    for name in ADVANTAGES:
        assert name in msg
    assert "did you mean 'rloo'" in msg
    with pytest.raises(ValueError, match="did you mean 'gspo'"):
        resolve("gpso", POLICY_LOSSES)


def test_resolve_bad_paths():
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        resolve("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'my_los'.*did you mean 'my_loss'"):
        resolve(f"{__name__}:my_los")
    with pytest.raises(ValueError, match="which is not callable"):
        resolve(f"{__name__}:MASK")
    with pytest.raises(ValueError, match="must be a name, a dotted path"):
        resolve(3, ADVANTAGES)


def test_registry_register():
    reg = Registry("widget")
    reg.register("a")(my_loss)
    assert reg["a"] is my_loss
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(my_kwargs_loss)
    with pytest.raises(ValueError, match="unknown widget 'b'"):
        resolve("b", reg)


def test_weir_algo_imports_torch_and_stdlib_only():
    import ast
    import sys
    from pathlib import Path

    import weir.algo

    # triton: imported on first use by the opt-in Triton kernels (kernel="triton"), as torch.compile
    # imports it on CUDA
    allowed = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)
    for path in Path(weir.algo.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed or name == "weir.plugins", (
                    f"{path.name} imports {name}"
                )
    from tests.fresh_python import printed_words

    loaded = printed_words("import sys, weir.algo; print(' '.join(sorted(sys.modules)))")
    weir_modules = {m for m in loaded if m.startswith("weir.")}
    assert all(m.startswith(("weir.algo", "weir.plugins")) for m in weir_modules), weir_modules
    for heavy in ("transformers", "pydantic", "yaml"):
        assert heavy not in loaded
