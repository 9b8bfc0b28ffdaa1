"""GUI: a small screen-based environment for vision-language agents, drawn with PIL.

A screen is 32x32 pixels: a 2x2 grid of 16-pixel cells, which the tiny VLM sees as exactly one image
token per cell (8-pixel patches merged 2x2). Each cell's background encodes where it is (its red
channel grows with the column, its green channel with the row), so a token's cell can be read from
the token itself; on it sit the elements: buttons (squares), menu items and list items (discs) in
red, green, blue or yellow, and a text field (a white box, outlined in black once focused, with a
dark bar once something is typed).

The goal is stated in text; the model acts with one action per turn, on the grid's coordinates
(column x, row y, each 0 or 1)::

    click(x, y)        type("word")        scroll(down) / scroll(up)

Four kinds of goal, 1 to 3 steps when played well:

- ``press``: "Press red."                  click the red button.
- ``menu``:  "Open red, pick blue."        click the red button, then the blue item of its menu.
- ``form``:  "Type go, press green."       click the field, type the word, click the green button
  (pressing with another word in the field does nothing).
- ``list``:  "Scroll, pick yellow."        the list shows 2 of its 4 items; scroll down, click.

A wrong click, or any action that is not one of the three, changes nothing; an episode allows the
steps of its goal plus two, so a mistake can be made good. Each step returns the action-level reward
(1 when the action was valid and moved toward the goal: one of the actions that make progress from
this state, else 0) and ``info["success"]``; the task-level reward (`success`) is 1 when the goal
was reached. The rows of ``stage="action"`` (train split only) start at a random step of the
expert's episode, with the expert's turns so far as the conversation, and allow one action: the
single-step episodes of action-level RL. Test rows are always whole episodes (held-out goals:
layouts, targets and words drawn from seeds disjoint from the train split's).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from weir.rollout.observation import Observation

__all__ = [
    "DESCRIPTION",
    "REWARD",
    "GuiEnv",
    "expert_actions",
    "make_rows",
    "render",
    "sft_rows",
    "success",
]

REWARD = "weir.tasks.gui:success"
DESCRIPTION = (
    "a vision-language agent clicks, types and scrolls on 32x32 PIL screens to reach a goal"
)
SIDE, CELL, GRID = 32, 16, 2
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 220),
    "yellow": (230, 200, 30),
}
WORDS = ("go", "ok", "hi", "yes", "no", "up")
KINDS = ("press", "menu", "form", "list")
STEPS = {"press": 1, "menu": 2, "form": 3, "list": 2}
ELEMENTS = 2  # buttons on a screen, items in a menu (a form has its field and two buttons)
LIST_LEN, VIEW, LIST_COLUMN = 4, 2, 0
SLACK = 2  # actions beyond the goal's steps that an episode allows
_TEST_OFFSET = 1 << 40

_CLICK = re.compile(r"^\s*click\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*$")
_TYPE = re.compile(r'^\s*type\(\s*"([^"]*)"\s*\)\s*$')
_SCROLL = re.compile(r"^\s*scroll\(\s*(up|down)\s*\)\s*$")


def background(x: int, y: int) -> tuple[int, int, int]:
    """The background of cell (x, y): its red channel grows with the column, its green channel with
    the row, so each coordinate can be read off the cell on its own."""
    return (80 + 80 * x, 80 + 80 * y, 110)


@dataclass
class _State:
    screen: int = 0  # menu: 0 the buttons, 1 the opened menu
    focused: bool = False
    typed: str = ""
    offset: int = 0  # list: the first item shown
    done: bool = False
    success: bool = False
    actions: int = 0
    history: list[str] = field(default_factory=list)


def _at(elements: list, x: int, y: int) -> str | None:
    for colour, ex, ey in elements:
        if (ex, ey) == (x, y):
            return colour
    return None


def _cell_of(elements: list, colour: str) -> tuple[int, int]:
    for c, x, y in elements:
        if c == colour:
            return x, y
    raise ValueError(f"gui: no {colour} element")


def parse_action(text: str) -> tuple[str, Any] | None:
    """``("click", (x, y))``, ``("type", word)``, ``("scroll", "down")``, or None (not an action)."""
    if m := _CLICK.match(text):
        return "click", (int(m.group(1)), int(m.group(2)))
    if m := _TYPE.match(text):
        return "type", m.group(1)
    if m := _SCROLL.match(text):
        return "scroll", m.group(1)
    return None


def list_items(goal: dict[str, Any], state: _State) -> list[list]:
    """The list items on screen: (colour, column 1, row)."""
    shown = goal["items"][state.offset : state.offset + VIEW]
    return [[c, LIST_COLUMN, row] for row, c in enumerate(shown)]


def step_app(goal: dict[str, Any], state: _State, action: str) -> float:
    """Apply `action` to `state` (in place); the action-level reward: 1.0 when the action was
    valid and moved toward the goal, else 0.0 (and nothing changes)."""
    parsed = parse_action(action)
    state.actions += 1
    state.history.append(action)
    if parsed is None:
        return 0.0
    kind, arg = parsed
    g = goal["kind"]
    if g == "press":
        if kind == "click" and _at(goal["buttons"], *arg) == goal["target"]:
            state.success = True
            return 1.0
    elif g == "menu":
        elements = goal["buttons"] if state.screen == 0 else goal["items"]
        want = goal["open"] if state.screen == 0 else goal["pick"]
        if kind == "click" and _at(elements, *arg) == want:
            if state.screen == 0:
                state.screen = 1
            else:
                state.success = True
            return 1.0
    elif g == "form":
        if kind == "click" and tuple(arg) == tuple(goal["field"]) and not state.focused:
            state.focused = True
            return 1.0
        if kind == "type" and state.focused:
            before, state.typed = state.typed, arg
            return 1.0 if arg == goal["word"] and before != arg else 0.0
        pressed = kind == "click" and _at(goal["buttons"], *arg) == goal["press"]
        if pressed and state.typed == goal["word"]:
            state.success = True
            return 1.0
    elif g == "list":
        hidden = goal["items"].index(goal["pick"]) >= state.offset + VIEW
        if kind == "scroll" and arg == "down" and hidden:
            state.offset = LIST_LEN - VIEW
            return 1.0
        if kind == "click" and _at(list_items(goal, state), *arg) == goal["pick"]:
            state.success = True
            return 1.0
    return 0.0


def render(goal: dict[str, Any], state: _State) -> Any:
    """The current screen as a 32x32 RGB PIL image."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE))
    pen = ImageDraw.Draw(img)
    for y in range(GRID):
        for x in range(GRID):
            pen.rectangle(
                [x * CELL, y * CELL, x * CELL + CELL - 1, y * CELL + CELL - 1],
                fill=background(x, y),
            )

    def square(colour: str, x: int, y: int) -> None:
        pen.rectangle(
            [x * CELL + 3, y * CELL + 3, x * CELL + 12, y * CELL + 12], fill=COLOURS[colour]
        )

    def disc(colour: str, x: int, y: int) -> None:
        pen.ellipse(
            [x * CELL + 2, y * CELL + 2, x * CELL + 13, y * CELL + 13], fill=COLOURS[colour]
        )

    g = goal["kind"]
    if g == "press" or (g == "menu" and state.screen == 0):
        for c, x, y in goal["buttons"]:
            square(c, x, y)
    elif g == "menu":
        for c, x, y in goal["items"]:
            disc(c, x, y)
    elif g == "form":
        for c, x, y in goal["buttons"]:
            square(c, x, y)
        x, y = goal["field"]
        box = [x * CELL + 1, y * CELL + 4, x * CELL + 14, y * CELL + 11]
        pen.rectangle(box, fill=(255, 255, 255), outline=(0, 0, 0) if state.focused else None)
        if state.typed:
            pen.rectangle(
                [x * CELL + 3, y * CELL + 6, x * CELL + 12, y * CELL + 9], fill=(20, 20, 20)
            )
    else:
        for c, x, y in list_items(goal, state):
            disc(c, x, y)
    return img


def expert_actions(goal: dict[str, Any]) -> list[str]:
    """The shortest action sequence that reaches `goal`."""
    g = goal["kind"]

    def click(cell: tuple[int, int]) -> str:
        return f"click({cell[0]}, {cell[1]})"

    if g == "press":
        return [click(_cell_of(goal["buttons"], goal["target"]))]
    if g == "menu":
        return [
            click(_cell_of(goal["buttons"], goal["open"])),
            click(_cell_of(goal["items"], goal["pick"])),
        ]
    if g == "form":
        return [
            click(goal["field"]),
            f'type("{goal["word"]}")',
            click(_cell_of(goal["buttons"], goal["press"])),
        ]
    index = goal["items"].index(goal["pick"]) - (LIST_LEN - VIEW)
    return ["scroll(down)", click((LIST_COLUMN, index))]


class GuiEnv:
    """The GUI environment (see the module docstring). One instance plays one episode of a row:
    ``{"goal": {...}, "start": k, "max_actions": m}``; with ``start > 0`` the episode begins after
    the expert's first k actions, shown as the conversation so far."""

    def reset(self, row: dict[str, Any]) -> Any:
        self.goal = row["goal"]
        self.state = _State()
        self.limit = int(row.get("max_actions", STEPS[self.goal["kind"]] + SLACK))
        start = int(row.get("start", 0))
        first = Observation(self.goal["text"], [render(self.goal, self.state)])
        if start == 0:
            return first
        messages: list[dict[str, Any]] = [{"role": "user", "content": first.parts()}]
        for action in expert_actions(self.goal)[:start]:
            step_app(self.goal, self.state, action)
            messages.append({"role": "assistant", "content": action})
            messages.append(
                {
                    "role": "user",
                    "content": Observation("", [render(self.goal, self.state)]).parts(),
                }
            )
        self.state.actions = 0
        return messages

    def step(self, action: str) -> tuple[Observation | None, float, bool, dict[str, Any]]:
        reward = step_app(self.goal, self.state, action)
        done = self.state.success or self.state.actions >= self.limit
        info = {"success": self.state.success, "valid": parse_action(action) is not None}
        if done:
            return None, reward, True, info
        return Observation("", [render(self.goal, self.state)]), reward, False, info


def success(sample: Any, row: dict[str, Any]) -> float:
    """The task-level reward: 1.0 when the episode reached its goal (the environment's last
    ``info["success"]``, `sample.metadata["env_info"]`), else 0.0."""
    info = sample.metadata.get("env_info") or {}
    return 1.0 if info.get("success") else 0.0


# -- rows -------------------------------------------------------------------------------------------


def _cells(rng: random.Random, k: int, avoid: tuple = ()) -> list[tuple[int, int]]:
    free = [(x, y) for y in range(GRID) for x in range(GRID) if (x, y) not in avoid]
    return rng.sample(free, k)


def make_goal(rng: random.Random, kind: str) -> dict[str, Any]:
    """A random goal of `kind` with its layout."""
    names = sorted(COLOURS)
    if kind == "press":
        cols = rng.sample(names, ELEMENTS)
        buttons = [[c, *xy] for c, xy in zip(cols, _cells(rng, ELEMENTS), strict=True)]
        target = rng.choice(cols)
        return {"kind": kind, "buttons": buttons, "target": target, "text": f"Press {target}."}
    if kind == "menu":
        cols = rng.sample(names, ELEMENTS)
        buttons = [[c, *xy] for c, xy in zip(cols, _cells(rng, ELEMENTS), strict=True)]
        items_c = rng.sample(names, ELEMENTS)
        items = [[c, *xy] for c, xy in zip(items_c, _cells(rng, ELEMENTS), strict=True)]
        opened, pick = rng.choice(cols), rng.choice(items_c)
        text = f"Open {opened}, pick {pick}."
        return {
            "kind": kind,
            "buttons": buttons,
            "items": items,
            "open": opened,
            "pick": pick,
            "text": text,
        }
    if kind == "form":
        field_xy = _cells(rng, 1)[0]
        cols = rng.sample(names, 2)
        buttons = [[c, *xy] for c, xy in zip(cols, _cells(rng, 2, (field_xy,)), strict=True)]
        word, press = rng.choice(WORDS), rng.choice(cols)
        return {
            "kind": kind,
            "field": list(field_xy),
            "buttons": buttons,
            "word": word,
            "press": press,
            "text": f"Type {word}, press {press}.",
        }
    items = [rng.choice(names) for _ in range(LIST_LEN - 1)]
    pick = rng.choice([c for c in names if c not in items[:VIEW]] or names)
    items.insert(rng.randrange(VIEW, LIST_LEN), pick)
    while pick in items[:VIEW]:  # the target starts hidden
        items[items.index(pick)] = rng.choice([c for c in names if c != pick])
    return {"kind": kind, "items": items, "pick": pick, "text": f"Scroll, pick {pick}."}


def _kinds(kinds: str) -> list[str]:
    out = [k.strip() for k in kinds.split(",") if k.strip()]
    bad = sorted(set(out) - set(KINDS))
    if not out or bad:
        raise ValueError(f"gui: kinds must be a subset of {list(KINDS)}, got {kinds!r}")
    return out


def make_rows(
    split: str,
    n: int,
    seed: int,
    *,
    stage: str = "task",
    kinds: str = ",".join(KINDS),
) -> list[dict[str, Any]]:
    """`n` rows of `split`. ``stage="task"``: whole episodes from the first screen;
    ``stage="action"`` (train split): one action from a random step of the expert's episode. Test
    rows are whole episodes whatever `stage` says. The same arguments give the same rows."""
    if split not in ("train", "test"):
        raise ValueError(f"gui: split must be 'train' or 'test', got {split!r}")
    if stage not in ("task", "action"):
        raise ValueError(f"gui: stage must be 'task' or 'action', got {stage!r}")
    names = _kinds(kinds)
    rng = random.Random(f"gui:{split}:{seed}")
    base = _TEST_OFFSET if split == "test" else 0
    rows = []
    for i in range(n):
        goal_seed = base + rng.randrange(_TEST_OFFSET)
        kind = names[i % len(names)]
        goal = make_goal(random.Random(goal_seed), kind)
        steps = STEPS[kind]
        row = {
            "prompt": goal["text"],
            "answer": " ".join(expert_actions(goal)),  # the expert's episode, for dumps
            "goal": goal,
            "kind": kind,
            "goal_seed": goal_seed,
            "task": "gui",
        }
        if stage == "action" and split == "train":
            row.update(start=rng.randrange(steps), max_actions=1)
        else:
            row.update(start=0, max_actions=steps + SLACK)
        rows.append(row)
    return rows


def sft_rows(
    n: int, seed: int, *, kinds: str = ",".join(KINDS), stage: str = "task"
) -> list[dict[str, Any]]:
    """`n` demonstration steps: for each step of the expert's episodes on train goals, the
    conversation so far (goal and screens as image parts, the expert's earlier actions) as
    ``messages`` and the next action as ``response`` -- exactly the context a multi-turn episode
    gives the model at that turn."""
    out: list[dict[str, Any]] = []
    for row in make_rows("train", n, seed, kinds=kinds):
        goal = row["goal"]
        state = _State()
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": Observation(goal["text"], [render(goal, state)]).parts()}
        ]
        for action in expert_actions(goal):
            keep = {k: v for k, v in row.items() if k != "prompt"}  # the messages are the prompt
            out.append({**keep, "messages": [dict(m) for m in messages], "response": action})
            step_app(goal, state, action)
            messages.append({"role": "assistant", "content": action})
            messages.append(
                {"role": "user", "content": Observation("", [render(goal, state)]).parts()}
            )
            if len(out) == n:
                return out
    return out
