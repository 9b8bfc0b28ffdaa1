"""The two sides of benchmarks/vs_trl.py, each run in its own process: weir (`weir_worker`, in
.venv) and TRL's GRPOTrainer (`trl_worker`, in .venv-trl), with the settings and the reward they
share. See vs_trl.py for what is compared and how the runs are matched.

Each worker takes a spec (workload, mode, seed, steps, run directory, model, prompt files, torch
threads) and returns its run as a dict: seconds per step, reward per step, the fairness counts
taken inside the process (trl_workloads.EpisodeCounter), and optimizer updates (a hook on every
torch optimizer).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import trl_workloads as twl

WORKLOADS = {
    # prompts per step, max new tokens (C: per episode), whether EOS ends a response, default
    # steps per run, multi-turn tool use; R and S: a real model (SmolLM2-135M-Instruct), its own
    # learning rate, the final number of its answer scored, its final model kept for the evaluator
    "A": {"prompts": 32, "max_new_tokens": 8, "eos": True, "steps": 12, "tools": False},
    "B": {"prompts": 8, "max_new_tokens": 128, "eos": False, "steps": 5, "tools": False},
    "C": {"prompts": 16, "max_new_tokens": twl.MAX_TOKENS, "eos": True, "steps": 8, "tools": True},
    "R": {
        "prompts": 16,
        "max_new_tokens": 32,
        "eos": True,
        "steps": 10,
        "tools": False,
        "real": True,
    },
    "S": {
        "prompts": 16,
        "max_new_tokens": 32,
        "eos": True,
        "steps": 8,
        "tools": False,
        "real": True,
    },
}
REAL_LR = 1e-5  # R and S: the rate of the outside run that first trained this model with weir
# C's problems differ widely in difficulty (a 3-digit result is copied worse than a 4-digit one), so
# both sides take its prompts in file order (no shuffle), the same 16 each step
IN_ORDER = {"A": False, "B": False, "C": True, "R": False, "S": False}
N = 8
LR = 5e-5
EPS_LOW, EPS_HIGH = 0.2, 0.28
ADV_EPS = 1e-4  # TRL adds 1e-4 to the group std
STALENESS = 1  # weir async's loop.max_staleness


def answer_reward(tokenizer, response_ids: list[int], answer: str, real: bool = False) -> float:
    """1.0 when the final model turn's text up to its end-of-turn token is the answer, else 0.0.

    Both sides decode the generated ids with the same tokenizer (special tokens kept), so the
    reward is the same function of the same tokens; in B the text after `<|end|>` is ignored, in C
    everything before the last `<|assistant|>` (tool calls and their results). `real` (R, S): the
    last integer of the decoded response (special tokens dropped) is the answer.
    """
    if real:
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        return float(twl.final_number(text) == str(answer))
    text = tokenizer.decode(response_ids, skip_special_tokens=False)
    return float(twl.final_turn_text(text).strip() == str(answer))


def _lr(w: dict) -> float:
    return REAL_LR if w.get("real") else LR


# --------------------------------------------------------------------------------- weir side


def weir_worker(spec: dict) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import weir

    updates = [0]
    register_optimizer_step_post_hook(lambda *a: updates.__setitem__(0, updates[0] + 1))
    from transformers import AutoTokenizer

    w = WORKLOADS[spec["workload"]]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    counts = twl.EpisodeCounter(tok, multi_turn=w["tools"])
    seen: set[str] = set()

    def reward(sample, row) -> float:
        if row.get("split") != "test":  # the final evaluation's episodes are not a step's
            counts.add(len(sample.prompt_ids), sample.response_ids)
            seen.add(row["prompt"])
        return answer_reward(tok, sample.response_ids, row["answer"], w.get("real", False))

    cfg = {
        "run": {
            "name": "vs_trl",
            "dir": spec["run_dir"],
            "seed": spec["seed"],
            "steps": spec["steps"],
            "eval_every": 0,
            "save_model": bool(w.get("real")),  # R, S: the final model, for the one evaluator
            "checkpoint_every": 0,
            "resume": "never",
        },
        "model": {"path": spec["model"], "threads": spec.get("threads", 1)},
        "data": {
            "task": None,
            "source": spec["prompts"],
            "eval_source": spec["eval"],
            "eval_size": 16,
            "shuffle": not IN_ORDER[spec["workload"]],
        },
        "rollout": {
            "n": N,
            "batch_prompts": spec.get("batch_prompts") or w["prompts"],
            "temperature": 1.0,
            "max_new_tokens": w["max_new_tokens"],
        },
        "algo": {
            "advantage": "grpo",
            "advantage_options": {"eps": ADV_EPS},
            "policy_loss": "ppo",
            "loss_options": {"eps_low": EPS_LOW, "eps_high": EPS_HIGH},
            "loss_agg": "token-mean",
            "old_logprobs": "recompute",
        },
        "train": {"lr": _lr(w), "grad_clip": 1.0, "mini_batches": 1, "epochs": 1},
        "loop": {
            "mode": spec["mode"].split("-")[0],
            "max_staleness": STALENESS,
            "on_weight_update": "finish" if "finish" in spec["mode"] else "continue",
        },
        "engine": {
            "kv_on_update": "keep" if "keep" in spec["mode"] else "recompute",
            "process": any(k in spec["mode"] for k in ("process", "2engines", "2cores")),
            "replicas": 2 if "2engines" in spec["mode"] or "2cores" in spec["mode"] else 1,
        },
        "telemetry": {"console": False, "trace": False},
    }
    if w["tools"]:
        for section, keys in twl.weir_agent_config().items():
            cfg[section] = {**cfg.get(section, {}), **keys}
    result = weir.run(cfg, reward=reward)
    steps = [m for m in result.history if "reward/mean" in m]
    # the last step also evaluates (run.steps is always an eval step): its time is not a step's
    timed = [m for m in steps if not any(k.startswith("eval/") for k in m)]
    return {
        "step_s": [m["time/step"] for m in timed],
        "reward": [m["reward/mean"] for m in steps],
        "length": [m["response/length_mean"] for m in steps],
        "model_dir": str(result.model_dir) if result.model_dir else None,
        "samples": [m.get("rollout/samples", float("nan")) for m in steps],
        "episodes_scored": len(counts.rows),
        "episode": counts.means(),
        "prompts_seen": sorted(seen),
        "optimizer_updates": updates[0],
        # weir's own count, to check the one above: tool calls per episode over the run's steps
        "own_tool_calls": statistics.fmean(m.get("agent/tool_calls_mean", 0.0) for m in steps),
        "split": {
            k: statistics.median(m.get(k, 0.0) for m in timed[1:] or timed)
            for k in (
                "time/generate",
                "time/train",
                "time/sync",
                "time/wait_for_batch",
                "time/drain",
                "mismatch/abs_logp_diff",
                "engine/recomputed_tokens",
            )
        },
    }


# --------------------------------------------------------------------------------- TRL side


def trl_worker(spec: dict) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(spec.get("threads", 1))
    import logging
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    w = WORKLOADS[spec["workload"]]
    updates = [0]
    register_optimizer_step_post_hook(lambda *a: updates.__setitem__(0, updates[0] + 1))
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    ds = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )

    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    counts = twl.EpisodeCounter(tok, multi_turn=w["tools"])
    seen: set[str] = set()
    tools = twl.trl_tool_setup(tok) if w["tools"] else {"config": {}, "trainer": {}}
    shown_tools = tools["trainer"].get("tools") or None  # what GRPOTrainer renders into prompts

    def reward(prompts, answer, completion_ids, **kwargs) -> list[float]:
        out = []
        for p, a, ids in zip(prompts, answer, completion_ids, strict=True):
            # the dataset's one user message, rendered as GRPOTrainer renders it (with tools=)
            text_p = tok.apply_chat_template(
                p[:1], tools=shown_tools, add_generation_prompt=True, tokenize=False
            )
            counts.add(len(tok(text_p, add_special_tokens=False)["input_ids"]), ids)
            seen.add(p[0]["content"])
            out.append(answer_reward(tok, ids, a, w.get("real", False)))
        return out

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.step_s: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now
            with progress.open("a") as f:  # read by the driver if the run times out
                f.write(json.dumps({"step_s": self.step_s[-1]}) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    batch = (spec.get("batch_prompts") or w["prompts"]) * N
    # the real model's step in one micro-batch holds every layer's activations for 128 sequences
    # (over 23 GB: the OOM killer stopped it on a 24 GB machine); weir splits a step into
    # micro-batches by tokens, so TRL gets micro-batches too, with the same one update per step
    # ("dapo" normalises by the generation batch's tokens, so the loss is the same)
    micro = 16 if spec["workload"] in ("R", "S") and batch % 16 == 0 else batch
    args = GRPOConfig(
        output_dir=spec["run_dir"],
        use_cpu=True,
        bf16=False,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=N,
        generation_batch_size=batch,
        max_completion_length=w["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=_lr(w),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        # GRPOConfig turns activation checkpointing on by default; weir does not checkpoint here,
        # and without it TRL's step is faster (it recomputed every forward in its backward)
        gradient_checkpointing=False,
        shuffle_dataset=not IN_ORDER[spec["workload"]],
        **tools["config"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    progress = Path(spec["run_dir"]) / "progress.jsonl"
    progress.unlink(missing_ok=True)
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[clock],
        **tools["trainer"],
    )
    clock.t = time.perf_counter()
    trainer.train()
    model_dir = None
    if w.get("real"):  # R, S: the final model, for the one evaluator
        model_dir = str(Path(spec["run_dir"]) / "model")
        trainer.save_model(model_dir)
    return {
        "step_s": clock.step_s,
        "reward": [lg["reward"] for lg in clock.logs],
        "length": [lg.get("completions/mean_length", float("nan")) for lg in clock.logs],
        "model_dir": model_dir,
        "samples": [float(batch)] * len(clock.logs),
        "episodes_scored": len(counts.rows),
        "episode": counts.means(),
        "prompts_seen": sorted(seen),
        "optimizer_updates": updates[0],
        # TRL's own count, to check the one above: tool calls per completion over the run's steps
        "own_tool_calls": statistics.fmean(
            lg.get("tools/call_frequency", 0.0) for lg in clock.logs
        ),
    }
