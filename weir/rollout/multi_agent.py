"""The multi-agent rollout function: roles act in turn, one shared policy told apart by role prompts.

One episode, roles R and a turn order from ``multi_agent.turns``; each role keeps its own view
(prompt ids + response ids), which becomes one `Sample`::

    for role in turns:
        if role has not acted:  prompt_ids[role] = template([system: role prompt, user: row prompt,
                                                             user: "a: ...\\nb: ..." (turns so far)])
        elif others spoke since: response[role] += encode(user turn "a: ...\\nb: ...")  -> loss_mask 0
        turn = engine.generate(prompt_ids[role] + response[role])                         -> loss_mask 1
    outcome = scorer(episode, row)          # {"team": T, "<role>": R_role} or T
    sample[role].reward = credit(outcome, role, multi_agent.credit)

Why a sample per role (and not one sample with per-token role ids): a role's turns are
generated from *its* view (its role prompt, the others' turns as user messages), so each view is
its own token sequence, and each is exact: the ids a role was trained on are the ids it was
conditioned on and produced. Each view carries one scalar reward, the role's credited one, so
the existing advantage estimators, losses, filters and batching apply unchanged; GRPO's groups
are (prompt, role) (`weir.train.batch.make_batch` keys groups by both), which gives each role its
own baseline. The loss mask is 1 only on the view's own role's turns, so a role's reward moves
the policy only through that role's tokens.

Group layout: ``rollout.n`` episodes per row, all their views in one `Group` (episode-major),
each tagged ``metadata["role"]`` and ``metadata["episode"]``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from weir.data.prompts import PromptTooLong, prompt_messages
from weir.data.sample import Group, Sample, Status
from weir.engine.base import Completion
from weir.plugins import resolve
from weir.rollout.env import maybe_await
from weir.rollout.multi_turn import ObservationCodec, _turn_seed, observation_codec, seeded_by_row
from weir.rollout.rewards import score
from weir.rollout.roles import Episode, Outcome, Turn, credit, parse_outcome
from weir.rollout.single_turn import RolloutContext

__all__ = [
    "rollout",
    "run_episode",
    "opening_messages",
    "turn_line",
    "make_scorer",
    "multi_agent_extras",
]


def turn_line(role: str, text: str) -> str:
    """How a turn is shown to the other roles: ``"<role>: <text>"``."""
    return f"{role}: {text}"


def opening_messages(
    row: dict, role_prompt: str | None, earlier: list[str], *, prompt_key: str = "prompt"
) -> list[dict[str, Any]]:
    """The chat a role first acts on: its role prompt as the system message, the row's prompt, and
    the turns taken before it (one per line) as one more user message. Task SFT data built with
    this renders exactly the prompt the role sees in RL."""
    messages = prompt_messages(row, prompt_key=prompt_key, system_prompt=role_prompt)
    if earlier:
        messages.append({"role": "user", "content": "\n".join(earlier)})
    return messages


@dataclass
class _View:
    """One role's trajectory while the episode runs."""

    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    turns: int = 0
    last_text: str = ""

    def add_turn(self, c: Completion) -> None:
        self.ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += c.logprobs
        self.versions += c.versions

    def add_context(self, obs: list[int]) -> None:
        self.ids += obs
        self.mask += [0] * len(obs)
        self.logprobs += [0.0] * len(obs)
        self.versions += [-1] * len(obs)


async def rollout(ctx: RolloutContext, row: dict) -> Group:
    """`ctx.sampling.n` episodes on `row` (config: ``ctx.extras["multi_agent"]``); their role views
    in one group."""
    ma = ctx.extras.get("multi_agent")
    if ma is None or not ma.roles:
        raise ValueError("weir.rollout.multi_agent:rollout needs multi_agent.roles in the config")
    scorer = (
        ctx.extras["multi_agent_scorer"] if "multi_agent_scorer" in ctx.extras else make_scorer(ma)
    )
    codec = observation_codec(ctx.tokenizer, role="user")  # other roles' turns: user messages
    ctx = seeded_by_row(ctx, row)  # turns arrive in an order that varies: seeds from the row
    episodes = await asyncio.gather(
        *(run_episode(ctx, row, ma, scorer, codec, index=i) for i in range(ctx.sampling.n))
    )
    samples = [s for ep in episodes for s in ep]
    for i, s in enumerate(samples):
        s.index = i
    return Group(samples=samples, row=row)


def make_scorer(ma: Any) -> Any:
    """The configured scorer with ``multi_agent.scorer_kwargs`` bound, or None; a bad path raises
    ValueError naming ``multi_agent.scorer`` (at start-up, through `multi_agent_extras`)."""
    if ma.scorer is None:
        return None
    fn = resolve(ma.scorer, {}, "multi_agent.scorer")
    return functools.partial(fn, **ma.scorer_kwargs) if ma.scorer_kwargs else fn


def multi_agent_extras(cfg: Any) -> dict[str, Any]:
    """What `rollout` reads from ``ctx.extras``: the multi_agent section, its resolved scorer, and
    the run's seed (the turns' sampling seeds derive from it)."""
    ma = cfg.multi_agent
    if not ma.roles:
        return {}
    return {
        "multi_agent": ma,
        "multi_agent_scorer": make_scorer(ma),
        "run_seed": cfg.run.seed,
    }


async def run_episode(
    ctx: RolloutContext,
    row: dict,
    ma: Any,
    scorer: Any,
    codec: ObservationCodec,
    index: int = 0,
) -> list[Sample]:
    """Play one episode; returns one scored sample per role that acted, in the order of
    ``multi_agent.roles``. Scorer failures fail the samples (counted), never the run."""
    roles = {r.name: r for r in ma.roles}
    order = list(ma.turns or roles)
    views = {name: _View() for name in roles}
    episode = Episode(row=row, roles=list(roles))
    status = Status.COMPLETED
    for t, name in enumerate(order):
        view, role = views[name], roles[name]
        if view.prompt_ids is None:
            view.prompt_ids = _encode_opening(ctx, row, role.prompt, view.pending)
        elif view.pending:
            obs = codec.encode("\n".join(view.pending))
            if len(view.ids) + len(obs) >= ma.max_tokens:
                status, episode.stop = Status.TRUNCATED, "max_tokens"
                break
            view.add_context(obs)
        view.pending = []
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
        (c,) = await _engine_of(ctx.engine, name).generate(view.prompt_ids + view.ids, params)
        view.add_turn(c)
        text = ctx.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        view.turns += 1
        view.last_text = text
        episode.turns.append(Turn(name, text, len(c.token_ids), c.finish_reason))
        if c.finish_reason != "stop":
            status = Status.ABORTED if c.finish_reason == "abort" else Status.TRUNCATED
            episode.stop = "abort" if c.finish_reason == "abort" else "length"
            break
        for other, v in views.items():
            if other != name:
                v.pending.append(turn_line(name, text))
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
                "metrics": {"agent/turns": float(v.turns)},
            },
        )
        for name, v in views.items()
        if v.turns
    }
    await _score(ctx, ma, scorer, episode, row, samples)
    return list(samples.values())


async def _score(
    ctx: RolloutContext,
    ma: Any,
    scorer: Any,
    episode: Episode,
    row: dict,
    samples: dict[str, Sample],
) -> None:
    """Score the episode once and credit each role's sample (``reward_info``: role, team_reward,
    role_reward, stop, turns)."""
    if not samples:
        return
    try:
        outcome = await _outcome(ctx, scorer, episode, row, samples)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        for s in samples.values():
            _fail(s, f"ScorerError: {type(e).__name__}: {e}")
        return
    for name, s in samples.items():
        s.reward_info.update(
            {
                "role": name,
                "team_reward": outcome.team,
                "stop": episode.stop,
                "turns": len(episode.turns),
            }
        )
        if name in outcome.roles:
            s.reward_info["role_reward"] = outcome.roles[name]
        try:
            s.reward = credit(outcome, name, ma.credit, ma.team_weight)
        except ValueError as e:
            _fail(s, f"ScorerError: {e}")
            continue
        s.reward_info["reward"] = s.reward


async def _outcome(
    ctx: RolloutContext, scorer: Any, episode: Episode, row: dict, samples: dict[str, Sample]
) -> Outcome:
    """The scorer's outcome; without a scorer, the reward function on the last turn (team only)."""
    if scorer is None:
        last = samples.get(episode.turns[-1].role) if episode.turns else None
        if last is None:
            raise ValueError("the episode has no turn to score")
        probe = replace(last, reward_info={}, metadata=dict(last.metadata))
        await score(ctx.reward_fn, probe, row, timeout_s=ctx.reward_timeout_s)
        if probe.reward is None:
            raise ValueError(probe.error or "the reward function gave no reward")
        return Outcome(probe.reward, {})
    if inspect.iscoroutinefunction(scorer) or inspect.iscoroutinefunction(
        getattr(scorer, "func", None)
    ):
        call = scorer(episode, row)
    else:  # a sync scorer runs in a thread, so a slow one does not stall the other episodes
        call = asyncio.to_thread(scorer, episode, row)
    try:
        result = await asyncio.wait_for(call, ctx.reward_timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"the scorer took longer than {ctx.reward_timeout_s} s") from None
    return parse_outcome(await maybe_await(result), episode.roles)


def _engine_of(engine: Any, role: str) -> Any:
    """The engine that generates `role`'s turns: its own under multi_agent.policies=separate
    (`weir.engine.role_router.RoleRouter.for_role`), else the one shared policy's."""
    for_role = getattr(engine, "for_role", None)
    return for_role(role) if for_role is not None else engine


def _fail(sample: Sample, message: str) -> None:
    sample.status = Status.FAILED
    sample.error = message
    sample.reward = None


def _encode_opening(
    ctx: RolloutContext, row: dict, role_prompt: str | None, earlier: list[str]
) -> list[int]:
    """Prompt ids of a role's opening chat (`opening_messages`), with the configured template and
    prompt length limit."""
    p: dict[str, Any] = ctx.extras.get("prompt", {})
    messages = opening_messages(
        row,
        role_prompt if role_prompt is not None else p.get("system_prompt"),
        earlier,
        prompt_key=p.get("prompt_key", "prompt"),
    )
    tok = ctx.tokenizer
    if p.get("use_chat_template", True) and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok("\n\n".join(str(m["content"]) for m in messages))["input_ids"]
    ids = [int(i) for i in ids]
    limit = p.get("max_prompt_tokens")
    if limit is not None and len(ids) > limit:
        raise PromptTooLong(len(ids), limit, row.get("_index"))
    return ids
