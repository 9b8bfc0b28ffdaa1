"""The relay task: rows, the scorer (team and each role), SFT rows that are the episode's prompts."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.rollout.test_multi_agent import TOK, RoleEngine, ctx_for
from weir.config.schema import MultiAgentConfig
from weir.data.prompts import encode_prompt
from weir.rollout.multi_agent import rollout
from weir.rollout.roles import Episode, Turn
from weir.tasks import relay
from weir.tasks.arithmetic import split_of

ROW = relay._row(3, 4, 5)


def episode(first: str | None, second: str | None) -> Episode:
    turns = [Turn(r, t, len(t)) for r, t in (("first", first), ("second", second)) if t is not None]
    return Episode(row=ROW, roles=["first", "second"], turns=turns)


def test_rows_and_splits():
    assert ROW == {
        "prompt": "3+4+5",
        "answer": "12",
        "first_answer": "7",
        "last": 5,
        "task": "relay",
    }
    test = relay.make_rows("test", 2000, seed=0)
    train = relay.make_rows("train", 50, seed=0)
    problems = {r["prompt"] for r in test}
    assert all(split_of(p) == "test" for p in problems)  # every test problem, then repeats
    assert 50 < len(problems) < 200 and not problems & {r["prompt"] for r in train}
    for r in train:
        a, b, c = (int(x) for x in r["prompt"].split("+"))
        assert (r["answer"], r["first_answer"], r["last"]) == (str(a + b + c), str(a + b), c)
    assert relay.make_rows("train", 50, seed=0) == train != relay.make_rows("train", 50, seed=1)
    with pytest.raises(ValueError, match="digits"):
        relay.make_rows("train", 5, 0, digits=3)


@pytest.mark.parametrize(
    "first, second, expected",
    [
        ("7", "12", (1.0, 1.0, 1.0)),  # both parts right
        ("8", "13", (0.0, 0.0, 1.0)),  # first wrong, second relayed it faithfully: team fails
        ("7", "13", (0.0, 1.0, 0.0)),  # first right, second added wrong
        ("8", "12", (1.0, 0.0, 0.0)),  # second ignored first's line and recomputed: team right
        ("x", "12", (1.0, 0.0, 0.0)),  # no number from first: nothing to relay
        ("7", None, (0.0, 1.0, 0.0)),  # the episode ended before the second acted
        (" 7", "12 ", (1.0, 1.0, 1.0)),
    ],
)
def test_score_by_hand(first, second, expected):
    got = relay.score(episode(first, second), ROW)
    assert (got["team"], got["first"], got["second"]) == expected


@given(
    st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.integers(-3, 3), st.integers(-3, 3)
)
def test_team_is_right_iff_the_errors_cancel(a, b, c, e1, e2):
    """first says a+b+e1, second says (that)+c+e2: first right iff e1=0, second right iff e2=0,
    team right iff e1+e2=0 (so both right gives the team, one wrong alone never does)."""
    row = relay._row(a, b, c)
    x, y = a + b + e1, a + b + e1 + c + e2
    if x < 0 or y < 0:  # no negative lines in this task
        return
    ep = Episode(
        row=row,
        roles=["first", "second"],
        turns=[Turn("first", str(x), 1), Turn("second", str(y), 1)],
    )
    got = relay.score(ep, row)
    assert got == {"team": float(e1 + e2 == 0), "first": float(e1 == 0), "second": float(e2 == 0)}


def test_sft_rows_are_the_episode_prompts_and_corrupt_as_asked():
    """Each SFT row renders the very ids the role is prompted with in an episode; targets are
    right, or off by one in the last digit, in the asked proportion; the second builds on the line
    it is shown, wrong or not."""
    engine = RoleEngine({relay.PROMPTS["first"]: ["8"], relay.PROMPTS["second"]: ["13"]})
    ma = MultiAgentConfig(
        roles=[{"name": n, "prompt": p} for n, p in relay.PROMPTS.items()],
        scorer="weir.tasks.relay:score",
        credit="role",
    )
    group = asyncio.run(rollout(ctx_for(engine, ma, scorer=relay.score), ROW))
    first, second = group.samples
    assert (first.reward, second.reward) == (0.0, 1.0)  # 8 is wrong; 8 + 5 = 13 relayed right
    rows = relay.sft_rows(1000, seed=0, corrupt=0.3, wrong_lines=0.5)
    by_role = {r["role"]: r for r in rows}
    for sample, role in ((first, "first"), (second, "second")):
        messages = [dict(m) for m in by_role[role]["messages"]]
        messages[1]["content"] = "3+4+5"
        if role == "second":
            messages[2]["content"] = "first: 8"
        assert encode_prompt(TOK, {"messages": messages}) == sample.prompt_ids
    wrong = {"first": 0, "second": 0}
    shown_wrong = 0
    for r in rows:
        a, b, c = (int(x) for x in r["messages"][1]["content"].split("+"))
        if r["role"] == "first":
            right = str(a + b)
        else:
            line = int(r["messages"][2]["content"].removeprefix("first: "))
            shown_wrong += line != a + b
            right = str(line + c)
        wrong[r["role"]] += r["response"] != right
        assert r["response"] in (right, right[:-1] + str((int(right[-1]) + 1) % 10))
    assert len(rows) == 2000
    assert 250 < wrong["first"] < 350 and 250 < wrong["second"] < 350  # 30% of 1000, +-5 sd
    assert 430 < shown_wrong < 570
    with pytest.raises(ValueError, match="corrupt"):
        relay.sft_rows(10, 0, corrupt=1.5)
