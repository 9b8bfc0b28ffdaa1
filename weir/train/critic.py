"""The critic of PPO: a value model, its clipped value loss, optimizer and schedule, its state.

The value model is a causal LM's backbone (the decoder without its LM head) plus a linear value
head: ``V = w . h + b`` on the last hidden state ``h``. Either a separate model (`critic.model_path`,
by default a copy of the policy's initial weights), or the policy's own backbone
(`critic.shared_backbone`), whose parameters the critic's optimizer then also updates.

Alignment (as verl and OpenRLHF): the value of response token t is the value of the state *before*
it, read at the position that predicts token t, i.e. the same position whose logits give
``log pi(x_t | x_<t)``. For a sequence of prompt length p and response length n the values are
``head(h[p-1]), ..., head(h[p+n-2])``; the hidden state after the last response token is never
used (GAE takes ``V = 0`` after the last trained token). Values come out (B, T) like the batch's
response tensors, 0 beyond each response.
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weir import algo
from weir.config import Config
from weir.config.schema import CriticConfig, TrainConfig
from weir.telemetry.timeline import span
from weir.train.batch import TrainBatch
from weir.train.compute_copy import ComputeCopy
from weir.train.model import load_model, resolve_model_path
from weir.train.modes import grad_mode, prepare_for_training
from weir.train.optim import make_optimizer, make_schedule
from weir.train.packing import Layout, choose_layout, left_pad, micro_batches, pack
from weir.train.precision import Precision, compute_device, model_precision


@dataclass(frozen=True)
class CriticSettings:
    """What the critic reads from a run's config.

    critic: its own section. train: the trainer's section, for what the critic shares with the
    actor (device, dtypes, micro-batch token budget, packing, gradient checkpointing, and the
    mini-batch / epoch counts when the critic's are unset). total_steps: the critic's optimizer
    steps over the run (for the schedule).
    """

    critic: CriticConfig
    train: TrainConfig
    total_steps: int = 1

    @property
    def mini_batches(self) -> int:
        return self.critic.mini_batches or self.train.mini_batches

    @property
    def epochs(self) -> int:
        return self.critic.epochs or self.train.epochs

    @classmethod
    def from_config(cls, cfg: Config) -> CriticSettings:
        c = cfg.critic
        per_step = (c.mini_batches or cfg.train.mini_batches) * (c.epochs or cfg.train.epochs)
        return cls(critic=c, train=cfg.train, total_steps=max(1, cfg.run.steps * per_step))


class ValueModel(torch.nn.Module):
    """A causal LM's backbone and a linear value head (zero-initialised: every value starts at 0)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        p = next(backbone.parameters())
        self.head = torch.nn.Linear(hidden_size, 1, device=p.device, dtype=p.dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Values at every position: (b, L) float32 from the backbone's last hidden state."""
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def value_model_from(lm: torch.nn.Module, *, share: bool) -> ValueModel:
    """The value model on `lm`'s backbone: the very module when `share`, else a copy of it."""
    backbone = lm.base_model
    if backbone is lm:
        raise ValueError(
            f"critic: {type(lm).__name__} has no separate backbone to put a value head on"
        )
    if not share:
        backbone = copy.deepcopy(backbone)
    return ValueModel(backbone, int(lm.config.hidden_size))


def load_value_model(
    settings: CriticSettings,
    policy: torch.nn.Module,
    build_dir: Path,
    *,
    arch: str = "qwen3",
    seed: int = 0,
) -> ValueModel:
    """The run's value model per `critic.model_path` / `critic.shared_backbone`, on the policy's
    device and in its parameter dtype. A model with another vocabulary than the policy's cannot
    read the policy's token ids and is refused."""
    c = settings.critic
    if c.shared_backbone or c.model_path is None:
        return value_model_from(policy, share=c.shared_backbone)
    p = next(policy.parameters())
    path = resolve_model_path(c.model_path, build_dir, arch=arch, seed=seed)
    lm, _ = load_model(path, p.dtype, p.device)
    ours, theirs = policy.config.vocab_size, lm.config.vocab_size
    if ours != theirs:
        raise ValueError(
            f"critic.model_path={c.model_path!r} has a vocabulary of {theirs} tokens, the policy "
            f"{ours}: the critic must use the policy's tokenizer (or leave critic.model_path unset)"
        )
    return value_model_from(lm, share=False)


def response_values(
    model: ValueModel,
    sequences: list[list[int]],
    response_lengths: list[int],
    *,
    layout: Layout = "packed",
    pad_to: int | None = None,
) -> torch.Tensor:
    """(b, T) values of the states before each response token (see the module docstring).

    `packed`: one row, position ids restarting per sequence; `padded`: one left-padded row per
    sequence with an attention mask. Both give the same numbers up to kernel summation order.
    """
    device = compute_device(model)
    width = pad_to or max(response_lengths)
    out = torch.zeros(len(sequences), width, device=device)
    if layout == "packed":
        flat, positions, keep = pack(sequences, response_lengths)
        v = model(
            input_ids=torch.tensor([flat], device=device),
            position_ids=torch.tensor([positions], device=device),
        )[0, torch.tensor(keep, device=device)]
        rows = torch.split(v, response_lengths)
    else:
        ids, attn, positions = left_pad(sequences)
        longest = ids.shape[1]
        v = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=positions.to(device),
        )
        rows = [v[i, longest - n - 1 : longest - 1] for i, n in enumerate(response_lengths)]
    mask = torch.zeros_like(out, dtype=torch.bool)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = True
    return out.masked_scatter(mask, torch.cat(rows)) if rows else out


class Critic:
    """Value model, optimizer and schedule: values for GAE, and clipped value-loss updates."""

    def _precision(self, model: torch.nn.Module) -> Precision:
        """Device and dtypes of one process, as the actor's (`model_precision`)."""
        return model_precision(self.tcfg, model)

    def __init__(self, model: ValueModel, settings: CriticSettings) -> None:
        self.settings = settings
        self.cfg, self.tcfg = settings.critic, settings.train
        if not self.cfg.shared_backbone:  # a shared backbone is prepared by the actor
            prepare_for_training(model.backbone, checkpointing=self.tcfg.gradient_checkpointing)
        self.model = model
        p = next(model.parameters())
        self.precision = self._precision(model)
        # train.mixed_precision=compute_copy: as the actor (a shared backbone is copied for the
        # critic's passes, outside the actor's)
        self._copy = (
            ComputeCopy(model, self.precision.compute_dtype)
            if self.precision.mixed and self.precision.copy
            else None
        )
        self.device = p.device
        self.layout: Layout = self._choose_layout(model)
        self.optimizer = make_optimizer(
            model.parameters(),
            lr=self.cfg.lr,
            betas=self.tcfg.betas,
            weight_decay=self.cfg.weight_decay,
            offload=self.tcfg.offload_optimizer,
        )
        self.scheduler = make_schedule(
            self.optimizer,
            warmup_steps=self.cfg.warmup_steps,
            total_steps=settings.total_steps,
            kind=self.cfg.schedule,
            min_lr_ratio=self.cfg.min_lr_ratio,
        )
        self.steps = 0
        self.updates = 0
        self.skipped_updates = 0

    # -- data-parallel hooks: one process does everything; weir.train.sharded_critic overrides them --

    def _choose_layout(self, model: ValueModel) -> Layout:
        return choose_layout(model.backbone, self.tcfg.packing)

    def _idle_pass(self, backward: bool) -> None:
        """A forward (and backward) that moves nothing, for a rank with fewer micro-batches."""

    def _combine_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def _reduce(self, values: list[float]) -> list[float]:
        return values

    def _all_finite(self, finite: bool) -> bool:
        return finite

    @property
    def actor_frozen(self) -> bool:
        """Whether the coming RL step is one of critic.freeze_actor_steps (critic warm-up)."""
        return self.steps < self.cfg.freeze_actor_steps

    def _micro_batches(self, indices: list[int], seqs: list[list[int]]) -> list[list[int]]:
        budget = self.tcfg.micro_batch_tokens
        return [
            [indices[j] for j in local]
            for local in micro_batches([len(seqs[i]) for i in indices], budget, self.layout)
        ]

    def _computing(self):
        """The compute copy active, or autocast (`train.mixed_precision`)."""
        return self._copy.active() if self._copy is not None else self.precision.autocast()

    def _forward(self, batch: TrainBatch, idx: list[int], width: int) -> torch.Tensor:
        seqs, lens = batch.sequences, batch.response_lengths
        with self._computing():
            return response_values(
                self.model,
                [seqs[i] for i in idx],
                [lens[i] for i in idx],
                layout=self.layout,
                pad_to=width,
            )

    @torch.no_grad()
    def values(
        self, batch: TrainBatch, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(B, T) values of the batch's response tokens before this step's update.

        A sample with a non-finite value on a trained token is left out: returns the values (0
        there), `mask` without that sample, and the count in `critic/nonfinite_value_samples`.
        """
        batch = batch.to(self.device)
        width = batch.response_mask.shape[1]
        out = torch.zeros(len(batch), width, device=self.device)
        seqs = batch.sequences
        with self._computing():
            for idx in self._micro_batches(list(range(len(seqs))), seqs):
                if not idx:
                    self._idle_pass(backward=False)
                    continue
                with span("values", cat="train", sequences=len(idx)):
                    out[idx] = self._forward(batch, idx, width)
        out = self._combine_rows(out)
        m = mask.bool()
        bad = (~torch.isfinite(out) & m).any(1)
        values = torch.where(torch.isfinite(out), out, 0.0)
        return (
            values,
            mask * (~bad).unsqueeze(1),
            {"critic/nonfinite_value_samples": float(bad.sum().item())},
        )

    def train(
        self,
        batch: TrainBatch,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
    ) -> dict[str, float]:
        """One RL step of critic updates: `epochs x mini_batches` optimizer steps on the clipped
        value loss towards `returns`; returns `critic/*` metrics."""
        with span("critic", cat="train", samples=len(batch)):
            stats = self._train(batch.to(self.device), old_values, returns, mask)
        self.steps += 1
        return stats

    def _train(self, batch, old_values, returns, mask) -> dict[str, float]:
        start = time.perf_counter()
        m = mask.bool()
        sums: dict[str, float] = defaultdict(float)
        norms: list[float] = []
        mbs = self.settings.mini_batches
        for epoch in range(self.settings.epochs):
            order = torch.randperm(
                len(batch), generator=torch.Generator().manual_seed(self.updates + epoch)
            )
            for mb in order.chunk(mbs):
                self._update(batch, mb.sort().values.tolist(), m, old_values, returns, sums, norms)
        n = float(m.sum().item()) * self.settings.epochs
        finite = [g for g in norms if math.isfinite(g)]
        stats = {
            "critic/value_loss": sums["loss"] / max(sums["passes"], 1.0),
            "critic/value_error": sums["error"] / max(n, 1.0),
            "critic/clipfrac": sums["clipped"] / max(n, 1.0),
            "critic/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
            "critic/lr": self.scheduler.get_last_lr()[0],
            "critic/skipped_updates": float(self.skipped_updates),
            "time/critic": time.perf_counter() - start,
        }
        stats.update(explained(old_values, returns, m))
        return stats

    def _update(self, batch, mb, m, old_values, returns, sums, norms) -> None:
        """Accumulate the value-loss gradient over the micro-batches of mini-batch `mb`, then step."""
        num_tokens = float(m[mb].sum().item())
        if num_tokens == 0:
            self.scheduler.step()
            self.updates += 1
            return
        self.optimizer.zero_grad(set_to_none=True)
        width, loss_sum, finite = m.shape[1], 0.0, True
        clipped = error = 0.0
        with grad_mode(self.model.backbone, self.tcfg.gradient_checkpointing), self._computing():
            for idx in self._micro_batches(mb, batch.sequences):
                if not idx:
                    self._idle_pass(backward=True)
                    continue
                with span("critic_forward", cat="train", sequences=len(idx)):
                    v = self._forward(batch, idx, width)
                if not bool(torch.isfinite(v.detach())[m[idx]].all()):
                    # an overflow: NaN gradients, so the norm is NaN and the update is skipped
                    (v.nan_to_num().sum() * float("nan")).backward()
                    finite = False
                    continue
                out = algo.value_loss(
                    v,
                    old_values[idx],
                    returns[idx],
                    m[idx],
                    num_tokens=num_tokens,
                    clip=self.cfg.value_clip,
                    coef=self.cfg.loss_coef,
                )
                out.loss.backward()
                loss_sum += out.loss.item()
                clipped += out.clipfrac_sum
                error += out.error_sum
        loss_sum, clipped, error = self._reduce([loss_sum, clipped, error])
        sums["clipped"] += clipped
        sums["error"] += error
        finite = self._all_finite(finite)
        with span("critic_optimizer", cat="train"):
            clip = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if hasattr(norm, "full_tensor"):  # sharded (FSDP2) gradients: a DTensor norm
                norm = norm.full_tensor()
            norm = norm.item()
            if finite and math.isfinite(norm):
                self.optimizer.step()
                sums["loss"] += loss_sum
                sums["passes"] += 1
            else:
                self.skipped_updates += 1
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        norms.append(norm)
        self.updates += 1

    # -- state ---------------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The critic's own tensors: the whole value model, or only its head on a shared backbone
        (the policy's checkpoint holds the backbone)."""
        module = self.model.head if self.cfg.shared_backbone else self.model
        prefix = "head." if self.cfg.shared_backbone else ""
        return {prefix + k: v for k, v in module.state_dict().items()}

    def state_dict(self) -> dict:
        """Weights, optimizer, schedule and counters: all a checkpoint needs to continue exactly."""
        return {
            "weights": self.weights(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state["weights"], strict=False)
        if unexpected or (missing and not self.cfg.shared_backbone):
            raise ValueError(
                f"critic state does not fit this value model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; were critic.model_path or critic.shared_backbone changed?"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.updates = state["steps"], state["updates"]
        self.skipped_updates = state["skipped_updates"]

    def save(self, directory: Path) -> None:
        """Write `model.safetensors` (the critic's weights) and `state.pt` (the rest) under
        `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        weights = state.pop("weights")
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in weights.items()},
            directory / "model.safetensors",
        )
        torch.save(state, directory / "state.pt")

    def load(self, directory: Path) -> None:
        """Read what `save` wrote back into this critic."""
        if not (directory / "model.safetensors").exists():
            raise ValueError(
                f"{directory.parent}: this checkpoint has no critic state (written by a run "
                "without algo.advantage=gae?); set run.resume=never to start over"
            )
        state = torch.load(directory / "state.pt", weights_only=False)
        weights = load_file(directory / "model.safetensors", device=str(self.device))
        self.load_state_dict({"weights": weights, **state})


def explained(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Means of the values and returns, and the explained variance ``1 - Var(G - V) / Var(G)``
    over the trained tokens (1: the values predict the returns exactly; <= 0: no better than the
    mean)."""
    m = mask.bool()
    if not m.any():
        return {}
    v, g = values[m].double(), returns[m].double()
    var = g.var(unbiased=False)
    ev = 1.0 - (g - v).var(unbiased=False) / var if var > 0 else torch.tensor(float("nan"))
    return {
        "critic/values_mean": v.mean().item(),
        "critic/returns_mean": g.mean().item(),
        "critic/explained_variance": ev.item(),
    }
