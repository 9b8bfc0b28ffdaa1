"""textarena (``pip install 'weir[textarena]'``): a text game as a multi-agent episode, one role
per player, with one shared policy or a policy per role (``multi_agent.policies``).

```yaml
rollout: {function: weir.adapters.textarena:rollout, n: 4}
textarena: {env_id: Nim-v0, max_turns: 6}
multi_agent:
  roles: [{name: first}, {name: second}]      # player 0, player 1
  scorer: weir.adapters.textarena:game_rewards
  credit: role
```

The game decides who acts: each turn, ``env.get_observation()`` names the player and what it
sees; that role's view gets the observation as a user message (context: ``loss_mask`` 0) and
the policy's turn (``loss_mask`` 1), generated from the view's own ids (token-exact, as in
`weir.rollout.multi_agent`); the turn's text is ``env.step``'s action. The game ends when
textarena says so or after ``textarena.max_turns`` turns (a turn cut at ``max_new_tokens`` is
played as it is: the game judges it, as it judges any invalid move) (``truncated``, each player's reward
``draw_reward`` or textarena's). ``game_rewards`` turns textarena's per-player rewards into the
roles' rewards (and their mean into the team's); ``multi_agent.credit: role`` trains each role on
its own. Per-(prompt, role) advantages, metrics and evaluation are those of any multi-agent run
(docs/multi-agent.md). A row's ``env_seed`` seeds the game; its ``rollout.n`` episodes play the
same deal.

textarena keeps its game state in plain Python and some games draw from the global ``random``
module, so its calls run on the rollout's event loop (quick, and in a fixed order per episode);
an exception from the game fails that episode's samples (counted), never the run.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from weir.data.sample import Group, Sample, Status
from weir.rollout.multi_agent import _encode_opening, _engine_of, _fail, _score, _View
from weir.rollout.multi_turn import _turn_seed, observation_codec, seeded_by_row
from weir.rollout.roles import Episode, Turn
from weir.rollout.single_turn import RolloutContext

__all__ = ["rollout", "game_rewards", "check"]


def _ta() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise ImportError(
            "textarena.env_id needs the textarena package: pip install 'weir[textarena]'"
        ) from e
    return textarena


def _make(section: Any, num_players: int, seed: int | None) -> Any:
    env = _ta().make(section.env_id, **section.kwargs)
    env.reset(num_players=num_players, seed=seed)
    return env


def check(section: Any, ma: Any) -> Any:
    """Refuse, at the run's start and in one line, a game textarena does not have or that cannot
    be played by as many players as multi_agent.roles has roles. Returns `section`."""
    if not ma.roles:
        raise ValueError(
            "textarena.env_id needs multi_agent.roles, one per player in player order "
            "(e.g. [{name: first}, {name: second}])"
        )
    try:
        _make(section, len(ma.roles), 0).close()
    except ImportError:
        raise
    except Exception as e:
        raise ValueError(
            f"textarena game {section.env_id!r} with {len(ma.roles)} players (one per "
            f"multi_agent.roles): {type(e).__name__}: {e}"
        ) from None
    return section


def game_rewards(episode: Episode, row: dict) -> dict[str, float]:
    """The scorer of textarena episodes: each role's reward is its player's reward from
    textarena (recorded by `rollout` in ``episode.info["rewards"]``), the team's their mean."""
    rewards = episode.info.get("rewards")
    if not rewards:
        raise ValueError("the game recorded no rewards (weir.adapters.textarena:rollout sets them)")
    return {"team": sum(rewards.values()) / len(rewards), **rewards}


def _new_text(seen: str, obs: str, mode: str) -> str:
    """What a player is shown: the whole observation, or what is new since its last turn."""
    if mode == "last" and seen and obs.startswith(seen):
        return obs[len(seen) :].strip("\n") or obs
    return obs


async def rollout(ctx: RolloutContext, row: dict) -> Group:
    """`ctx.sampling.n` games on `row` (config: ``ctx.extras["textarena"]`` and
    ``ctx.extras["multi_agent"]``); their role views in one group."""
    section, ma = ctx.extras.get("textarena"), ctx.extras.get("multi_agent")
    if section is None or ma is None:
        raise ValueError(
            "weir.adapters.textarena:rollout needs textarena.env_id and multi_agent.roles"
        )
    scorer = ctx.extras.get("multi_agent_scorer") or game_rewards
    codec = observation_codec(ctx.tokenizer, role="user")
    ctx = seeded_by_row(ctx, row)
    episodes = await asyncio.gather(
        *(_episode(ctx, row, section, ma, scorer, codec, i) for i in range(ctx.sampling.n))
    )
    samples = [s for ep in episodes for s in ep]
    for i, s in enumerate(samples):
        s.index = i
    return Group(samples=samples, row=row)


async def _episode(
    ctx: RolloutContext, row: dict, section: Any, ma: Any, scorer: Any, codec: Any, index: int
) -> list[Sample]:
    roles = [r for r in ma.roles]
    views = {r.name: _View() for r in roles}
    seen = {r.name: "" for r in roles}
    episode = Episode(row=row, roles=[r.name for r in roles])
    status, error, env = Status.COMPLETED, None, None
    seed = row.get("env_seed")
    key = ctx.extras.get("prompt", {}).get("prompt_key", "prompt")
    try:
        env = _game(_make, section, len(roles), None if seed is None else int(seed))
        done = False
        for t in range(section.max_turns):
            pid, obs = _game(env.get_observation)
            role = roles[int(pid)]
            view = views[role.name]
            text = _new_text(seen[role.name], str(obs), section.observation)
            seen[role.name] = str(obs)
            if view.prompt_ids is None:
                view.prompt_ids = _encode_opening(ctx, {key: text}, role.prompt, [])
            else:
                obs_ids = codec.encode(text)
                if len(view.ids) + len(obs_ids) >= ma.max_tokens:
                    status, episode.stop = Status.TRUNCATED, "max_tokens"
                    break
                view.add_context(obs_ids)
            budget = ma.max_tokens - len(view.ids)
            if budget <= 0:
                status, episode.stop = Status.TRUNCATED, "max_tokens"
                break
            params = replace(
                ctx.sampling,
                n=1,
                max_new_tokens=min(role.max_new_tokens or ctx.sampling.max_new_tokens, budget),
                seed=_turn_seed(ctx.sampling.seed, view.prompt_ids, index, t),
            )
            engine = _engine_of(ctx.engine, role.name)
            (c,) = await engine.generate(view.prompt_ids + view.ids, params)
            view.add_turn(c)
            action = ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            view.turns += 1
            view.last_text = action
            episode.turns.append(Turn(role.name, action, len(c.token_ids), c.finish_reason))
            if c.finish_reason == "abort":  # regenerated by the asynchronous producer
                status, episode.stop = Status.ABORTED, "abort"
                break
            done, _ = _game(env.step, action)  # a turn cut at max_new_tokens is played too
            if done:
                break
        if not done and status == Status.COMPLETED:
            status, episode.stop = Status.TRUNCATED, "max_turns"
        rewards, _ = _game(env.close)
        env = None
        episode.info["rewards"] = _role_rewards(rewards, roles, section)
    except _GameError as e:  # the game must not end the run; engine errors propagate
        cause = e.__cause__
        error = f"EnvError: {type(cause).__name__}: {cause}"
    finally:
        if env is not None:
            with contextlib.suppress(Exception):
                env.close()
    samples = {
        name: Sample(
            prompt_ids=v.prompt_ids,
            response_ids=v.ids,
            loss_mask=v.mask,
            rollout_logprobs=v.logprobs,
            versions=v.versions,
            status=status,
            row=row,
            response_text=v.last_text,
            metadata={
                "role": name,
                "episode": index,
                "transcript": episode.transcript,
                "metrics": {"agent/turns": float(v.turns), "agent/env_errors": float(bool(error))},
            },
        )
        for name, v in views.items()
        if v.turns
    }
    if error is not None:
        for s in samples.values():
            _fail(s, error)
        return list(samples.values())
    await _score(ctx, ma, scorer, episode, row, samples)
    return list(samples.values())


class _GameError(Exception):
    """An exception raised by textarena (its __cause__)."""


def _game(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:
        raise _GameError(str(e)) from e


def _role_rewards(rewards: Any, roles: list[Any], section: Any) -> dict[str, float]:
    """textarena's ``{player id: reward}`` as ``{role: reward}``; an unfinished game (textarena
    gives none) scores ``draw_reward`` (default 0) for everyone."""
    out = {}
    for pid, role in enumerate(roles):
        r = None if not rewards else rewards.get(pid)
        if section.draw_reward is not None and (r is None or not rewards):
            r = section.draw_reward
        out[role.name] = float(r or 0.0)
    return out
