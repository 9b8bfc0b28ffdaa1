"""Workload C of benchmarks/vs_trl.py: multi-turn tool use (weir's calculator agent) on both sides.

The episode, token for token the same layout on both sides (weir's tiny chat template)::

    <|system|>tools:\\ncalc(expression): Evaluate arithmetic exactly.<|end|><|user|>47*86<|end|><|assistant|>
    <calc>47*86</calc><|end|>                      model turn 1 (a tool call, tag format)
    <|tool|>4042<|end|><|assistant|>               observation: not trained on
    4042<|end|>                                    model turn 2 (the answer)

weir plays it with `weir.rollout.multi_turn:rollout` and its `ToolEnv` (agent.tool_format tag,
show_tools on). TRL 1.16 plays it with `GRPOTrainer(tools=[calc])`: its tool loop parses each
completion with the tokenizer's `response_template` (`CALC_RESPONSE_TEMPLATE`, which reads the tag
format, since TRL only ships templates for the chat formats of known model families), runs the
tool, appends the tool turn the chat template renders (`<|tool|>...<|end|><|assistant|>`, the
same ids as weir's observation) and generates the next turn from the concatenated ids; tool
tokens are masked out of the loss on both sides. Both sides call this module's `calc`, list it in
the system turn (TRL always renders `tools=` into the prompt; weir with agent.show_tools), so the
SFT rows carry the same tool list as a system message (`tools_system_text`).

Where the two loops still differ (each side runs its own code; in the README's last invocation weir counted
22 tool errors or malformed calls in 6144 episodes, and at most 2.3% of a step's episodes ended
truncated, by turns or by tokens):

- a malformed call (`<calc>47*` left open): weir's parser reports it and the observation is
  `error: ...`; TRL's parser passes the rest of the turn to `calc`, whose exception becomes the
  observation `{'error': ...}`. Both go on with an error observation of different text.
- several calls in one turn: weir shows one observation with a line per result, TRL one tool turn
  per call.
- the token budget: weir asks for at most the tokens left, TRL generates up to
  max_completion_length a turn and cuts the excess (the same tokens; TRL may compute more); weir
  drops an observation that would reach the budget, TRL one that would pass it.

This module imports no weir and no TRL at import time: it is loaded by the weir process and by the
TRL process (.venv-trl has no weir), and by tests/rollout/test_vs_trl_workloads.py.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any

ASSISTANT, TOOL, END = "<|assistant|>", "<|tool|>", "<|end|>"
MAX_TURNS = 3  # model turns per episode: weir agent.max_turns; TRL max_tool_calling_iterations + 1
MAX_TOKENS = 64  # response tokens per episode (model + observation): weir agent.max_tokens; TRL max_completion_length
DIGITS = (2, 2)
TOOL_FRACTION = 0.4  # of the SFT problems solved with the tool (examples/calculator.yaml)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CALL_OPEN = re.compile(r"<calc>")

# TRL parses tool calls with a transformers `response_template` (regions opened and closed by
# patterns; `tokenizer.parse_response`). This one reads weir's tag format for the `calc` tool:
# `<calc>47*86</calc>` -> {"name": "calc", "arguments": {"expression": "47*86"}}; text outside the
# tags is the content, `<|end|>` closes the turn.
CALC_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": ASSISTANT,
    "fields": {
        "tool_calls": {
            "open_pattern": r"<(?P<name>calc)>",
            "close_pattern": r"</calc>",
            "repeats": True,
            "content": "text",
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": {"expression": "{content}"}},
            },
        },
        "content": {"close_pattern": r"<\|end\|>", "content": "text"},
    },
}


def calc(expression: str) -> str:
    """Evaluate arithmetic exactly.

    Args:
        expression: integers with + - * and parentheses, e.g. 47*86.
    """
    return str(_eval(ast.parse(expression.strip(), mode="eval").body))


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


_INTEGER = re.compile(r"-?\d[\d,]*")


def final_number(text: str) -> str | None:
    """The last integer written in `text` (thousands separators dropped), or None: the answer that
    workloads R and S score (a real model's chat answer, e.g. "47 + 85 = 132." gives "132")."""
    found = _INTEGER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_turn_text(text: str) -> str:
    """The last model turn of a decoded response (special tokens kept): the text after the last
    `<|assistant|>` (the whole text in a single-turn response), up to its `<|end|>`."""
    return text.rsplit(ASSISTANT, 1)[-1].split(END, 1)[0]


def split_episode(ids: list[int], end_id: int, tool_id: int, assistant_id: int) -> dict[str, Any]:
    """Split a response's ids into model turns and observations.

    A model turn runs up to and including `<|end|>`; when the next id is `<|tool|>`, an
    observation runs from it up to and including the next `<|assistant|>`, and the next model turn
    follows. Returns the model turns and the observations (lists of ids); together they are `ids`.
    """
    turns: list[list[int]] = []
    observations: list[list[int]] = []
    i = 0
    while i < len(ids):
        turn: list[int] = []
        while i < len(ids):
            turn.append(ids[i])
            i += 1
            if turn[-1] == end_id:
                break
        turns.append(turn)
        if i < len(ids) and ids[i] == tool_id:
            obs: list[int] = []
            while i < len(ids):
                obs.append(ids[i])
                i += 1
                if obs[-1] == assistant_id:
                    break
            observations.append(obs)
    return {"turns": turns, "observations": observations}


class EpisodeCounter:
    """The fairness counts of scored episodes, the same function of the same ids on both sides:
    model tokens, observation tokens, model turns, tool calls (`<calc>` opened in a model turn) and
    tool errors (observations that say `error`) per episode, and prompt tokens per sample.
    Without `multi_turn` a response is one model turn (in workload B the model writes on past its
    `<|end|>`, and what follows is no observation)."""

    def __init__(self, tokenizer: Any, multi_turn: bool = True) -> None:
        self.tok = tokenizer
        self.multi_turn = multi_turn
        self.ids = {k: tokenizer.convert_tokens_to_ids(k) for k in (END, TOOL, ASSISTANT)}
        self.rows: list[dict[str, float]] = []

    def add(self, prompt_tokens: int, response_ids: list[int]) -> None:
        ids = list(response_ids)
        parts = (
            split_episode(ids, self.ids[END], self.ids[TOOL], self.ids[ASSISTANT])
            if self.multi_turn
            else {"turns": [ids], "observations": []}
        )
        texts = [self.tok.decode(t, skip_special_tokens=False) for t in parts["turns"]]
        observations = [self.tok.decode(o) for o in parts["observations"]]
        self.rows.append(
            {
                "prompt_tokens": float(prompt_tokens),
                "model_tokens": float(sum(len(t) for t in parts["turns"])),
                "obs_tokens": float(sum(len(o) for o in parts["observations"])),
                "turns": float(len(parts["turns"])),
                "tool_calls": float(sum(len(_CALL_OPEN.findall(t)) for t in texts)),
                "tool_errors": float(sum("error" in o for o in observations)),
            }
        )

    def means(self) -> dict[str, float]:
        """Per-episode means of each count (NaN before any episode)."""
        keys = ("prompt_tokens", "model_tokens", "obs_tokens", "turns", "tool_calls", "tool_errors")
        n = len(self.rows)
        return {k: (sum(r[k] for r in self.rows) / n if n else float("nan")) for k in keys}


def tools_system_text(tokenizer: Any) -> str:
    """The system turn's text that the chat template renders for ``tools=[calc]`` (as TRL renders
    it, through transformers' schema of `calc`), to put the same tool list into SFT rows."""
    user = [{"role": "user", "content": "u"}]
    text = tokenizer.apply_chat_template(user, tools=[calc], tokenize=False)
    head = "<|system|>"
    if not text.startswith(head):
        raise ValueError(
            f"trl_workloads: the chat template renders no system turn for tools: {text!r}"
        )
    return text[len(head) : text.index(END)]


def with_tools_system(row: dict[str, Any], system: str) -> dict[str, Any]:
    """An SFT row (``prompt`` or ``messages``, and ``response``) with `system` as its first message."""
    chat = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    out = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    out["messages"] = [{"role": "system", "content": system}, *chat]
    return out


def prepare_calculator(workdir: Path, sft_rows: int, sft_epochs: int) -> dict[str, Path]:
    """The SFT'd calculator model (made once, reused) and the prompt files of workload C.

    SFT as examples/calculator.yaml: `weir.tasks.calculator.sft_rows` (2-digit x 2-digit, 40% of
    problems with the tool), each row with the tool list as its system message, so that the model
    sees in SFT the prompt both sides show it in RL. Runs in weir's environment.
    """
    import weir
    from weir.rollout.tools import ToolRegistry
    from weir.tasks import calculator
    from weir.tasks.tiny_model import build_tokenizer

    tok = build_tokenizer()
    system = tools_system_text(tok)
    user = [{"role": "user", "content": "47*86"}]
    theirs = tok.apply_chat_template(user, tools=[calc], tokenize=False, add_generation_prompt=True)
    mine = tok.apply_chat_template(
        user, tools=ToolRegistry([calc]).schemas(), tokenize=False, add_generation_prompt=True
    )
    sft_prompt = tok.apply_chat_template(
        [{"role": "system", "content": system}, *user], tokenize=False, add_generation_prompt=True
    )
    if not theirs == mine == sft_prompt:
        raise RuntimeError(
            f"trl_workloads: prompts differ: TRL {theirs!r}, weir {mine!r}, SFT {sft_prompt!r}"
        )
    root = workdir / "calculator"
    root.mkdir(parents=True, exist_ok=True)
    prompts, held_out = root / "prompts.jsonl", root / "eval.jsonl"
    for path, split, n in ((prompts, "train", 4000), (held_out, "test", 16)):
        rows = calculator.make_rows(split, n, seed=0, digits=DIGITS)
        path.write_text(
            "".join(
                json.dumps({"prompt": r["prompt"], "answer": r["answer"], "split": split}) + "\n"
                for r in rows
            )
        )
    model = root / "sft" / "model"
    if not (model / "config.json").exists():
        print(
            f"[prepare C] SFT of the tiny model on {sft_rows} calculator problems x {sft_epochs} epochs ..."
        )
        rows = calculator.sft_rows(sft_rows, 0, tool_fraction=TOOL_FRACTION, digits=DIGITS)
        data = root / "sft.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps(with_tools_system(r, system)) + "\n" for r in rows))
        weir.sft(
            {
                "run": {"name": "vs_trl_calc_sft", "dir": str(root / "sft"), "seed": 0},
                "model": {"path": "tiny:tiny", "threads": 1},
                "data": {"task": None, "source": str(prompts), "eval_source": str(held_out)},
                "sft": {"data": str(data), "batch_size": 64, "lr": 3e-3, "epochs": sft_epochs},
                "telemetry": {"console": False},
            }
        )
    return {"model": model, "prompts": prompts, "eval": held_out}


def weir_agent_config() -> dict[str, dict[str, Any]]:
    """weir's config sections that make a run play workload C's episodes."""
    return {
        "rollout": {"function": "weir.rollout.multi_turn:rollout", "max_new_tokens": MAX_TOKENS},
        "agent": {
            "tools": ["trl_workloads:calc"],
            "tool_format": "tag",
            "show_tools": True,
            "max_turns": MAX_TURNS,
            "max_tokens": MAX_TOKENS,
        },
    }


def trl_tool_setup(tokenizer: Any) -> dict[str, Any]:
    """TRL's side of workload C: the GRPOConfig keys and GRPOTrainer arguments (the episode's token
    budget is max_completion_length = MAX_TOKENS, set from the workload), and the tokenizer given
    the response template that parses the tag format."""
    tokenizer.response_template = CALC_RESPONSE_TEMPLATE
    return {
        "config": {"max_tool_calling_iterations": MAX_TURNS - 1},
        "trainer": {"tools": [calc]},
    }
