"""Why RL does or does not add to SFT on the GUI task: what a policy leaves for RL to learn.

For one model (an SFT or RL stage's ``model/`` directory) this plays the evaluation goals twice,
greedy (what the demo reports) and sampled at the rollout temperature with ``--n`` episodes per
goal (what RL trains on), and prints per goal kind:

- greedy and sampled success, and pass@n (the goals some sampled episode reaches);
- the spread of sampled outcomes per goal: the fraction of goals whose ``n`` episodes all fail or
  all succeed (a GRPO group with all-equal rewards has zero advantage: no gradient);
- the greedy failure modes: first action wrong, recovered after a wrong first action, and failed
  episodes whose actions are all the same (greedy repeats a click that changed nothing: the screen
  and the conversation barely change, so neither does the argmax).

Usage::

    python benchmarks/gui_rl_diagnose.py MODEL_DIR [--validation] [--n 4] [key=value ...]

``--validation`` plays 192 goals of the *train* split drawn with seed 999 (disjoint from the run
seeds' train goals and from the held-out test split), so that settings can be tuned without looking
at the held-out goals; the overrides go to examples/gui.yaml (e.g. ``data.task_options.kinds=press``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from weir.config import load_config
from weir.loop.components import build
from weir.rollout.evaluate import evaluate
from weir.tasks import gui

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def actions(sample, tokenizer) -> list[str]:
    """The model's actions of an episode: its trained spans, one per turn, decoded."""
    out, cur = [], []
    for tok, m in zip(sample.response_ids, sample.loss_mask, strict=True):
        if m:
            cur.append(tok)
        elif cur:
            out.append(tokenizer.decode(cur, skip_special_tokens=True).strip())
            cur = []
    if cur:
        out.append(tokenizer.decode(cur, skip_special_tokens=True).strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--validation", action="store_true")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--config", default=str(EXAMPLES / "gui.yaml"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    tmp = Path(tempfile.mkdtemp(prefix="gui_diag_"))
    over = [*args.overrides, f"model.path={args.model}", f"run.dir={tmp / 'run'}", "run.steps=0"]
    cfg = load_config(args.config, over)
    if args.validation:
        kinds = cfg.data.task_options.get("kinds", ",".join(gui.KINDS))
        rows = gui.make_rows("train", cfg.data.eval_size, seed=999, kinds=kinds)
        src = tmp / "validation.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = load_config(args.config, [*over, f"data.eval_source={src}"])
    parts = build(cfg, tmp / "run")
    try:
        greedy, g_groups = evaluate(parts.eval_ctx, parts.eval_rows, parts.rollout_fn)
        sampled_ctx = parts.eval_ctx.with_sampling(n=args.n, temperature=cfg.rollout.temperature)
        _, s_groups = evaluate(sampled_ctx, parts.eval_rows, parts.rollout_fn)
    finally:
        parts.close()
    which = "validation (train split, seed 999)" if args.validation else "held-out"
    print(
        f"{args.model}: {len(g_groups)} {which} goals; sampled T={cfg.rollout.temperature:g}, n={args.n}"
    )
    stats: dict[str, Counter] = defaultdict(Counter)
    for g in g_groups:
        s = g.samples[0]
        kind = g.row["kind"]
        ok = bool(s.reward and s.reward >= 1.0)
        acts = actions(s, parts.tokenizer)
        first_ok = bool((s.reward_info.get("env_rewards") or [0.0])[0] > 0)
        st = stats[kind]
        st["goals"] += 1
        st["greedy"] += ok
        st["first_wrong"] += not first_ok
        st["recovered"] += (not first_ok) and ok
        st["repeats"] += (not ok) and len(acts) > 1 and len(set(acts)) == 1
    for g in s_groups:
        st = stats[g.row["kind"]]
        wins = sum(bool(s.reward and s.reward >= 1.0) for s in g.samples)
        st["sampled"] += wins
        st["pass"] += wins > 0
        st["all_fail"] += wins == 0
        st["all_win"] += wins == len(g.samples)
    head = "kind    goals greedy sampled pass@n  all-fail all-win | 1st wrong recovered repeats"
    print(head)
    for kind in [*sorted(stats), "all"]:
        st = sum(stats.values(), Counter()) if kind == "all" else stats[kind]
        n = st["goals"]
        print(
            f"{kind:7} {n:5} {st['greedy'] / n:6.1%} {st['sampled'] / (n * args.n):7.1%}"
            f" {st['pass'] / n:6.1%} {st['all_fail'] / n:8.1%} {st['all_win'] / n:7.1%} |"
            f" {st['first_wrong']:9} {st['recovered']:9} {st['repeats']:7}"
        )
    print(
        f"greedy eval/accuracy {greedy['eval/accuracy']:.3f} (binomial s.e. "
        f"{(greedy['eval/accuracy'] * (1 - greedy['eval/accuracy']) / len(g_groups)) ** 0.5:.3f})"
    )


if __name__ == "__main__":
    main()
