"""The teacher of on-policy distillation (`algo.distill`): the log-probs it gives the student's own
sampled tokens, as a (B, T) tensor like the reference's.

Three kinds (`algo.distill.teacher`):

- ``reference``: the actor's reference model (the initial policy), scored like the reference;
- a model directory (or ``tiny:<size>``, resolved by the loop): loaded beside the policy, frozen, and
  scored in batches by the actor's own forward (its micro-batches, kernels and compute dtype; one
  padded row per sequence, exact for every architecture weir runs, since the teacher's may differ
  from the policy's); on Ray every trainer rank holds its FSDP2 shard of it, as of the reference;
- a served model: the base URL of an OpenAI-compatible server. weir asks its ``/v1/completions``
  for the log-probs of given token ids: the sequence (prompt + response) as the prompt, as token
  ids, ``max_tokens: 1``, ``echo: true``, ``logprobs: 0``, ``prompt_logprobs: 0`` and
  ``return_tokens_as_token_ids: true``. It reads vLLM's ``choices[0].prompt_logprobs`` (one
  ``{token_id: {logprob}}`` per prompt position, None for the first), or else the OpenAI echo
  format ``choices[0].logprobs`` (``tokens`` as ``token_id:<id>`` and ``token_logprobs``). A
  server whose answer has neither, or scores other ids than those sent (it re-tokenized text), is
  refused at start-up with the reason. On Ray only rank 0 asks; the others receive its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from weir.config.sections import DistillConfig
from weir.train.batch import TrainBatch

if TYPE_CHECKING:
    from weir.train.actor import Actor

__all__ = [
    "EndpointTeacher",
    "ModelTeacher",
    "TeacherError",
    "check_teacher_tokenizer",
    "distill_advantages",
    "distill_loss",
    "is_endpoint",
    "make_teacher",
]


class TeacherError(ValueError):
    """A teacher that cannot score the student's tokens (one line: which, why, the fix)."""


def is_endpoint(teacher: str | None) -> bool:
    return teacher is not None and teacher.startswith(("http://", "https://"))


class ModelTeacher:
    """A frozen model scored by the actor's own forward (the reference, or a loaded teacher)."""

    def __init__(
        self, actor: Actor, model: torch.nn.Module, layout: str | None, temperature: float
    ):
        self.actor, self.model, self.layout, self.temperature = actor, model, layout, temperature

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        # the reference replays the policy's recorded routing (its architecture); another teacher
        # routes by itself
        return self.actor.logprobs(
            self.model,
            batch,
            temperature=self.temperature,
            layout=self.layout,
            replay=self.model is self.actor.ref,
        )


class EndpointTeacher:
    """A teacher behind an OpenAI-compatible server (see the module docstring)."""

    def __init__(self, url: str, cfg: DistillConfig, actor: Actor | None = None) -> None:
        import httpx

        if cfg.teacher_temperature != 1.0:
            raise TeacherError(
                f"algo.distill.teacher={url}: a server's prompt log-probs are at temperature 1; "
                "set algo.distill.teacher_temperature=1"
            )
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.actor = actor
        # only rank 0 asks; the other trainer ranks receive its rows
        self.asks = actor is None or actor.is_first_rank
        asks = self.asks
        self._client = httpx.Client(timeout=cfg.endpoint_timeout_s)
        self.model = cfg.endpoint_model
        if asks:
            if self.model is None:
                self.model = self._first_model()
            self._probe()

    def _post(self, ids: Sequence[int]) -> dict[str, Any]:
        import httpx

        body = {
            "model": self.model,
            "prompt": list(ids),
            "max_tokens": 1,
            "temperature": 1.0,
            "echo": True,
            "logprobs": 0,
            "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        try:
            resp = self._client.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as err:
            raise TeacherError(
                f"algo.distill.teacher={self.url}: no answer from /v1/completions ({err})"
            ) from None
        if resp.status_code >= 400:
            raise TeacherError(
                f"algo.distill.teacher={self.url}: /v1/completions answered {resp.status_code}: "
                f"{resp.text[:200]}"
            )
        return resp.json()

    def _first_model(self) -> str:
        import httpx

        try:
            data = self._client.get(f"{self.url}/v1/models").json().get("data") or []
        except (httpx.HTTPError, ValueError) as err:
            raise TeacherError(
                f"algo.distill.teacher={self.url}: no answer from /v1/models ({err}); is it an "
                "OpenAI-compatible server? (or set algo.distill.endpoint_model)"
            ) from None
        if not data:
            raise TeacherError(f"algo.distill.teacher={self.url}: /v1/models lists no model")
        return str(data[0]["id"])

    def _probe(self) -> None:
        """Refuse, with the reason, a server that cannot give the log-probs of given ids."""
        ids = [1, 2, 3, 4]
        got = self.score(ids, 3)
        if len(got) != 3:
            raise TeacherError(f"algo.distill.teacher={self.url}: scored {len(got)} of 3 tokens")

    def score(self, ids: Sequence[int], n: int) -> list[float]:
        """Log-probs of the last `n` of `ids`, each given the ids before it."""
        out = self._post(ids)
        choice = (out.get("choices") or [{}])[0]
        why = f"algo.distill.teacher={self.url}"
        plp = choice.get("prompt_logprobs")
        if plp:
            if len(plp) != len(ids):
                raise TeacherError(
                    f"{why}: prompt_logprobs has {len(plp)} entries for {len(ids)} ids"
                )
            values = []
            for pos in range(len(ids) - n, len(ids)):
                entry = plp[pos] or {}
                hit = entry.get(str(ids[pos]), entry.get(ids[pos]))  # type: ignore[call-overload]
                if hit is None:
                    raise TeacherError(
                        f"{why}: prompt_logprobs at position {pos} lacks the id sent "
                        f"({ids[pos]}); the server scored other tokens"
                    )
                values.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
            return values
        lp = choice.get("logprobs") or {}
        tokens, values = lp.get("tokens"), lp.get("token_logprobs")
        if not tokens or not values:
            raise TeacherError(
                f"{why}: the answer has no per-token log-probs of the prompt (neither vLLM's "
                "prompt_logprobs nor echo's logprobs.token_logprobs); serve the teacher with vLLM, "
                "or use a model directory as the teacher"
            )
        if len(tokens) < len(ids) or any(
            t != f"token_id:{i}" for t, i in zip(tokens, ids, strict=False)
        ):
            raise TeacherError(
                f"{why}: echo returned other tokens than the ids sent ({tokens[:4]}...); it must "
                "take token ids and honour return_tokens_as_token_ids"
            )
        return [float(v) for v in values[len(ids) - n : len(ids)]]

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        out = torch.zeros_like(batch.response_mask)
        if self.asks:
            seqs, lens = batch.sequences, batch.response_lengths
            with ThreadPoolExecutor(self.cfg.endpoint_concurrency) as pool:
                rows = list(pool.map(self.score, seqs, lens))
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
        if self.actor is None:
            return out
        return self.actor._from_first_rank(out.to(self.actor.device))


def make_teacher(actor: Actor) -> ModelTeacher | EndpointTeacher | None:
    """The teacher `algo.distill.teacher` names, or None when distillation is off."""
    cfg = actor.acfg.distill
    name = actor.settings.teacher
    if name is None:
        return None
    if name == "reference":
        assert actor.ref is not None
        return ModelTeacher(actor, actor.ref, None, cfg.teacher_temperature)
    if is_endpoint(name):
        return EndpointTeacher(name, cfg, actor)
    model = actor._load_teacher(name)
    return ModelTeacher(actor, model, "padded", cfg.teacher_temperature)


def check_teacher_tokenizer(path: str, tokenizer: Any) -> None:
    """Refuse a teacher directory whose tokenizer is not the policy's: the student's token ids would
    mean other tokens to it."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise TeacherError(
            f"algo.distill.teacher={path}: cannot load its tokenizer ({err})"
        ) from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise TeacherError(
            f"algo.distill.teacher={path}: its tokenizer is not the policy's (vocabularies of "
            f"{len(theirs)} and {len(tokenizer)} tokens differ); distillation scores the student's "
            "token ids, so the teacher must share the policy's tokenizer"
        )


def distill_advantages(
    cfg: DistillConfig,
    task: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages with distillation (`weir.algo.reverse_kl_advantages`): in `advantage`
    mode ``reward_weight * A_task - coef * (student - teacher)`` per token; in `loss` mode
    ``reward_weight * A_task`` (the reverse KL is then a loss term, `distill_loss`). `student`: the
    behaviour policy's log-probs of the sampled tokens. Metrics: the mean reverse KL and teacher
    log-prob per trained token."""
    from weir import algo

    m = mask.bool()
    k = algo.reverse_kl(student, teacher, m)
    n = m.sum().clamp(min=1)
    stats = {
        "distill/reverse_kl": float(k.sum() / n),
        "distill/teacher_logp": float(torch.where(m, teacher, 0.0).sum() / n),
    }
    if cfg.mode == "loss":
        return cfg.reward_weight * task, stats
    adv = algo.reverse_kl_advantages(
        student,
        teacher,
        m,
        coef=cfg.coef,
        task_advantages=task,
        task_weight=cfg.reward_weight,
    )
    return adv, stats


def distill_loss(
    cfg: DistillConfig,
    logp: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str,
    num_tokens: float,
    num_seqs: float,
    max_len: int,
) -> torch.Tensor:
    """`loss` mode's term ``coef * agg(sg(logp - teacher) * logp)`` of one micro-batch, aggregated
    with the mini-batch's global counts (`weir.algo.reverse_kl_loss`)."""
    from weir import algo

    per_token = algo.reverse_kl_loss(logp, teacher, mask)
    return cfg.coef * algo.aggregate_loss(
        per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )
