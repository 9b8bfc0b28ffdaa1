"""Build the pieces of a run from its config: model, data, reward, engine, rollout contexts, trainer.

This is the one place that knows every package; the drivers only call what it returns.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from weir.adapters import (
    adapter_extras,
    adapter_reward,
    adapter_reward_kwargs,
    adapter_rows,
    adapter_scores,
)
from weir.config import Config
from weir.config.devices import resolve_device
from weir.data.prompts import DataError, PromptTooLong, encode_prompt
from weir.data.sources import PromptSource, load_rows
from weir.data.vision import VisionInputs, encode_vision_prompt, processor_of
from weir.engine.base import SamplingParams
from weir.engine.kv_budget import kv_options
from weir.engine.support import check_model_path, model_support
from weir.engine.torch_engine import TorchEngine
from weir.loop.engine_memory import check_kv_budget
from weir.loop.resume import say
from weir.loop.role_policies import build_role_policies
from weir.loop.selfcheck import run_selfcheck
from weir.loop.server_engines import engine_placement, policy_engine, server_engine
from weir.plugins import resolve
from weir.rollout.combine import check_reward
from weir.rollout.multi_agent import multi_agent_extras
from weir.rollout.multi_turn import agent_extras
from weir.rollout.rewards import REWARDS, get_reward
from weir.rollout.single_turn import RolloutContext
from weir.rollout.vision_episode import vision_extras
from weir.sandbox import configure as configure_sandbox
from weir.tasks import get_task
from weir.train.actor import Actor, ActorSettings
from weir.train.critic import Critic, CriticSettings, load_value_model
from weir.train.liger_scope import strip_liger
from weir.train.lora import save_final_model
from weir.train.model import eos_token_ids, load_model, resolve_model_path
from weir.train.precision import Precision, setup_device
from weir.train.teacher import check_teacher_tokenizer, is_endpoint


@dataclass
class Components:
    model: torch.nn.Module
    tokenizer: Any
    engine: TorchEngine
    trainer: Actor
    prompts: PromptSource
    eval_rows: list[dict]
    ctx: RolloutContext
    eval_ctx: RolloutContext
    rollout_fn: Callable
    keep: Callable | None
    sync: Any = None  # Ray: the weight sync from the trainer ranks to the engines; in one process
    # only lora.sync=adapter's (weir.sync.adapter_sync), else the engine takes the trainer's tensors
    critic: Critic | None = None  # algo.advantage=gae: PPO's value model
    cluster: Any = None  # cluster.type=ray: the RayParts to shut down at the end
    policies: Any = None  # multi_agent.policies=separate: weir.loop.role_policies.RolePolicies
    eval_breakdown: str | None = None  # eval.breakdown: the row field eval reports accuracy by

    def close(self) -> None:
        """Stop the engine (and on Ray the trainer ranks and the placement groups)."""
        self.engine.close()
        if self.cluster is not None:
            self.cluster.shutdown()

    def trained_model(self) -> torch.nn.Module:
        """The driver's model holding the trainer's current weights (one process only: on Ray the
        driver's model has no weights, see `save_model`)."""
        if self.cluster is not None:
            raise RuntimeError("on Ray the driver holds no weights; use Components.save_model")
        return self.model

    def policy_models(self) -> dict[str, torch.nn.Module]:
        """The trained models by their sub-directory of a checkpoint's ``model/``: ``""`` for the
        one policy, each role's name with multi_agent.policies=separate."""
        if self.policies is not None:
            return dict(self.policies.models)
        return {"": self.trained_model()}

    def save_model(self, run_dir: Path) -> Path:
        """The trainer's current weights as an HF directory, ``<run>/model``. One process: LoRA
        merged (and the adapter alone in ``<run>/adapter``). On Ray the ranks write the weights
        from their shards (one tensor gathered at a time) and the driver adds config and tokenizer."""
        out = run_dir / "model"
        if self.policies is not None:  # one HF directory per role: <run>/model/<role>
            return self.policies.save_models(out, self.tokenizer)
        if self.cluster is None:
            return save_final_model(self.model, self.tokenizer, run_dir)
        from weir.train.sharded_checkpoint import save_model_files

        for role in self.cluster.roles or ("",):  # separate policies: <run>/model/<role>
            self.trainer.save_hf(str(out / role), self.trainer.cluster.bucket_mb, role)
            save_model_files(self.model, self.tokenizer, out / role)
        return out


def task_rows(cfg: Config, split: str) -> list[dict]:
    """Rows of the configured data source or built-in task for `split` ("train" or "test"): for
    "test", `data.eval_size` of them (the first N rows of `data.eval_source`)."""
    d = cfg.data
    source = d.source if split == "train" else d.eval_source
    if source is not None:
        rows = load_rows(source)
        if split == "test" and len(rows) > d.eval_size:
            say(
                f"evaluating the first {d.eval_size} of the {len(rows)} rows of {source} (data.eval_size)"
            )
            rows = rows[: d.eval_size]
        return rows
    rows = adapter_rows(cfg, split)  # reasoning-gym, verifiers, an environment's reset seeds
    if rows is not None:
        return rows
    if d.task is None:
        raise ValueError(
            f"no {split} data: set data.eval_source (or data.task for a built-in task)"
        )
    n = d.train_size if split == "train" else d.eval_size
    seed = cfg.run.seed if split == "train" else cfg.run.seed + 10_000
    rows = get_task(d.task).make_rows(split, n, seed, **d.task_options)
    return rows[:n]


class PromptEncoder:
    """row -> prompt ids with the configured template and `data.on_long_prompt` policy.

    `skip` raises `PromptTooLong` (collection skips and counts the row); `truncate` cuts the *first*
    tokens, keeping the end of the prompt where the template opens the assistant turn (the question's
    start is lost, not the cue to answer), and counts it in `truncated`; `error` stops the run.
    """

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        d = cfg.data
        self.policy, self.max_tokens = d.on_long_prompt, d.max_prompt_tokens
        self.truncated = 0
        self._encode = partial(
            encode_prompt,
            tokenizer,
            prompt_key=d.prompt_key,
            system_prompt=d.system_prompt,
            use_chat_template=d.chat_template,
        )
        processor = processor_of(tokenizer)
        self._encode_vision = None
        if processor is not None:  # a vision-language model: its processor places the images
            self._encode_vision = partial(
                encode_vision_prompt,
                processor,
                prompt_key=d.prompt_key,
                image_key=cfg.vision.image_key,
                system_prompt=d.system_prompt,
                allow_remote=cfg.vision.allow_remote_urls,
            )

    @property
    def takes_images(self) -> bool:
        return self._encode_vision is not None

    def encode(self, row: dict) -> tuple[list[int], VisionInputs | None]:
        """Prompt ids and pixel inputs (None without images) of `row`. A prompt with images is
        never truncated (its image tokens must stay whole): over the limit it is skipped or stops
        the run as `data.on_long_prompt` says (`truncate` skips it)."""
        if self._encode_vision is None:
            return self(row), None
        ids, vision = self._encode_vision(row)
        return self._limit(ids, row, truncate=vision is None), vision

    def __call__(self, row: dict) -> list[int]:
        if self._encode_vision is not None:
            ids, vision = self.encode(row)
            if vision is not None:
                raise ValueError(
                    "this prompt has images: encode it with PromptEncoder.encode (ids and pixels)"
                )
            return ids
        return self._limit(self._encode(row), row)

    def _limit(self, ids: list[int], row: dict, truncate: bool = True) -> list[int]:
        if len(ids) <= self.max_tokens:
            return ids
        if self.policy == "truncate" and truncate:
            self.truncated += 1
            return ids[-self.max_tokens :]
        err = PromptTooLong(len(ids), self.max_tokens, row.get("_index"))
        if self.policy == "error":
            raise DataError(
                f"{err}; raise data.max_prompt_tokens or set data.on_long_prompt=skip|truncate"
            )
        raise err


def reward_function(cfg: Config, reward: Callable | None = None) -> Callable:
    if cfg.reward.components and reward is None:
        if cfg.reward.function not in (None, "combine"):
            raise ValueError(
                f"reward.components and reward.function={cfg.reward.function!r} both set; "
                "unset reward.function (the components are summed)"
            )
        components = [c.model_dump() for c in cfg.reward.components]
        for c in components:
            if _takes_answer_key(c["function"]) and cfg.data.answer_key != "answer":
                c["kwargs"].setdefault("answer_key", cfg.data.answer_key)
        check_reward("combine", {"components": components})
        return get_reward("combine", components=components)
    spec = (
        reward
        or cfg.reward.function
        or adapter_reward(cfg)
        or (get_task(cfg.data.task).reward if cfg.data.task and not adapter_scores(cfg) else None)
    )
    if spec is None and (
        cfg.agent.reward == "env" or cfg.multi_agent.scorer is not None or adapter_scores(cfg)
    ):
        return _no_task_reward
    if spec is None:
        raise ValueError(
            "no reward: set reward.function (a built-in name or a dotted path) or data.task"
        )
    kwargs = dict(cfg.reward.kwargs)
    if spec == adapter_reward(cfg):
        kwargs = {**adapter_reward_kwargs(cfg), **kwargs}
    if cfg.data.answer_key != "answer" and _takes_answer_key(spec):
        kwargs.setdefault("answer_key", cfg.data.answer_key)
    fn = get_reward(spec, **kwargs)
    check_reward(spec, kwargs)
    return fn


def _takes_answer_key(spec: Any) -> bool:
    """A built-in reward that reads the ground truth (data.answer_key retargets it)."""
    return (
        isinstance(spec, str)
        and spec in REWARDS
        and "answer_key" in inspect.signature(REWARDS[spec]).parameters
    )


def _no_task_reward(sample: Any, row: dict) -> float:
    """The task reward when only the environment rewards (agent.reward: env); never called."""
    return 0.0


def make_engine(cfg: Config, model: torch.nn.Module, tokenizer: Any) -> TorchEngine:
    """The built-in engine on the trainer's module (colocated sync) or on its own copy (always
    for LoRA: a plain model holding the merged weights; always in a child process with
    engine.process, `weir.engine.process_engine`).

    Asynchronous training always copies: the trainer updates its weights while the engine decodes.
    So does an engine on another device or in another dtype than the trainer's (fp32 master
    weights, bf16 engine): weight updates cast into the copy.
    """
    concurrent = cfg.loop.mode == "async"
    device, dtype = engine_placement(cfg, model)
    p = next(model.parameters())
    if cfg.lora.enabled:
        # the engine runs a plain copy holding the merged weights W + s B A (weir.train.lora)
        from weir.train.lora import merged_model

        model = merged_model(model).to(device=device, dtype=dtype).eval()
    elif (
        concurrent
        or cfg.engine.process
        or not cfg.engine.share_weights
        or (p.device, p.dtype) != (device, dtype)
    ):
        model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
        strip_liger(model)  # train.fuse=liger fused the trainer's modules, not the engine's
    options = dict(
        eos_token_ids=eos_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        max_batch_size=cfg.engine.max_batch_size,
        seed=cfg.run.seed,
        num_threads=cfg.loop.engine_threads if concurrent else None,
        record_routing=cfg.algo.routing_replay,
        **kv_options(cfg.engine),
    )
    if cfg.engine.process and cfg.engine.replicas > 1:
        engine = _local_replicas(cfg.engine.replicas, model, options, cfg.run.seed)
    elif cfg.engine.process:
        from weir.engine.process_engine import ProcessEngine

        engine = ProcessEngine(model, **options)
    else:
        engine = TorchEngine(model, **options)
    check_kv_budget(cfg, engine)
    return engine


def _local_replicas(count: int, model: torch.nn.Module, options: dict, seed: int) -> Any:
    """`count` engine processes on `model` (each child copies it) behind one engine.

    Unless `options` name the children's threads, they share this process's torch threads: a sync
    run on 2 threads with 2 replicas gives each child one, not two (4 threads on 2 cores).
    """
    from weir.engine.local_replicas import LocalReplicas
    from weir.engine.process_engine import ProcessEngine

    if options.get("num_threads") is None:
        options = {**options, "num_threads": max(1, torch.get_num_threads() // count)}
    started: list[ProcessEngine] = []
    try:
        for _ in range(count):
            started.append(ProcessEngine(model, **options))
    except BaseException:
        for e in started:
            e.close()
        raise
    return LocalReplicas(started, seed=seed)


def make_contexts(
    cfg: Config, engine: TorchEngine, tokenizer: Any, reward_fn: Callable | None = None
) -> tuple[RolloutContext, RolloutContext]:
    """Rollout contexts for training (rollout.* sampling) and evaluation (eval.* sampling), which
    score with `reward_fn` (the config's, `reward_function(cfg)`, when None)."""
    r, e = cfg.rollout, cfg.eval
    configure_sandbox(cfg.sandbox)  # code rewards and the python tool run programs there
    processor = processor_of(tokenizer)
    placeholders = (
        frozenset({processor.image_token_id, processor.video_token_id})
        if processor
        else frozenset()
    )
    train_ctx = RolloutContext(
        engine=engine,
        tokenizer=tokenizer,
        sampling=SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=sorted(placeholders),
        ),
        reward_fn=reward_fn if reward_fn is not None else reward_function(cfg),
        encode=(encode := PromptEncoder(cfg, tokenizer)),
        encode_vision=encode.encode if encode.takes_images else None,
        placeholder_ids=placeholders,
        reward_timeout_s=cfg.reward.timeout_s,
        extras={
            **agent_extras(cfg),
            **multi_agent_extras(cfg),
            **adapter_extras(cfg),
            **vision_extras(cfg),
        },
    )
    eval_ctx = train_ctx.with_sampling(
        n=e.n,
        temperature=e.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=e.max_new_tokens or r.max_new_tokens,
        seed=cfg.run.seed,
    )
    return train_ctx, eval_ctx


def load_run_model(cfg: Config, run_dir: Path) -> tuple[torch.nn.Module, Any]:
    """Seed, set threads, build a `tiny:` model if asked, and load model and tokenizer.

    The model is placed on `train.device` in `train.param_dtype` (the trainer's master weights);
    on Ray the driver's copy stays on the CPU (the ranks load their own).
    """
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.cluster.type == "ray":
        device = torch.device("cpu")
    else:
        device = resolve_device(cfg.train.device, key="train.device")
    precision = Precision.from_config(cfg.train, device=device)
    setup_device(
        precision, deterministic=cfg.run.deterministic, cudnn_attention=cfg.model.cudnn_attention
    )
    return load_model(run_model_path(cfg, run_dir), precision.param_dtype, precision.device)


def driver_model(cfg: Config, run_dir: Path) -> tuple[torch.nn.Module, Any]:
    """A Ray run's driver: the model's config and tokenizer, its parameters on the meta device."""
    from weir.train.meta_init import driver_model as meta_model

    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    dtype = Precision.from_config(cfg.train, device=torch.device("cpu")).param_dtype
    return meta_model(run_model_path(cfg, run_dir), dtype)


def resolve_teacher(cfg: Config, run_dir: Path) -> None:
    """`algo.distill.teacher=tiny:<size>`: build it next to the run directory (seed
    model.init_seed + 1, so that it is not the policy's own initialisation) and name its directory;
    a teacher directory must share the policy's tokenizer (`weir.train.teacher`)."""
    d = cfg.algo.distill
    if d.teacher is None or d.teacher == "reference" or is_endpoint(d.teacher):
        return
    if d.teacher.startswith("tiny:"):
        d.teacher = resolve_model_path(
            d.teacher, run_dir.parent / ".models", arch=cfg.model.arch, seed=cfg.model.init_seed + 1
        )
    from transformers import AutoTokenizer

    check_teacher_tokenizer(d.teacher, AutoTokenizer.from_pretrained(run_model_path(cfg, run_dir)))


def run_model_path(cfg: Config, run_dir: Path) -> str:
    """The model directory (a `tiny:` model is built next to the run directory once)."""
    return resolve_model_path(
        cfg.model.path, run_dir.parent / ".models", arch=cfg.model.arch, seed=cfg.model.init_seed
    )


def build(
    cfg: Config,
    run_dir: Path,
    *,
    reward: Callable | None = None,
    rollout: Callable | None = None,
    filter: Callable | None = None,
) -> Components:
    """Everything a driver needs; plugins given as Python objects take precedence over the config."""
    if not cfg.model.path.startswith("tiny:"):  # refuse what weir cannot run exactly, early
        check_model_path(run_model_path(cfg, run_dir))  # (a GGUF file: its converted directory)
    resolve_teacher(cfg, run_dir)
    ray_parts = policies = scored = None
    if cfg.cluster.type == "ray":  # the ranks and replicas load the weights, never the driver
        model, tokenizer = driver_model(cfg, run_dir)
    else:
        model, tokenizer = load_run_model(cfg, run_dir)
    model_support(model.config)  # and with the attention implementation it was loaded with
    if processor_of(tokenizer) is not None:
        _check_vision_run(cfg)
    if cfg.cluster.type == "ray":  # trainer ranks, engine replicas and reward workers: actors
        from weir.loop.ray_build import build_ray, critic_model_path, ray_roles

        scored = reward_function(cfg, reward)  # checked before the cluster starts its workers
        ray_parts = build_ray(
            cfg,
            run_dir,
            run_model_path(cfg, run_dir),
            eos_token_ids(model, tokenizer),
            roles=ray_roles(cfg, run_dir) if separate_policies(cfg) else None,
            critic_path=critic_model_path(cfg, run_dir),
            reward=scored,
        )
        trainer, engine = ray_parts.trainer, ray_parts.router
    elif separate_policies(cfg):  # a model, trainer and engine per role
        policies = build_role_policies(
            cfg,
            run_dir,
            model,
            tokenizer,
            run_model_path(cfg, run_dir),
            partial(policy_engine, run_dir=run_dir, make_engine=make_engine),
            run_selfcheck if cfg.model.selfcheck and cfg.engine.type == "torch" else None,
        )
        trainer, engine = policies.trainer, policies.engine
    else:
        if cfg.lora.enabled:  # adapters on the trainer's model (weir.train.lora)
            from weir.train.lora import LoraActor, apply_lora

            model = apply_lora(
                model, cfg.lora, base_path=run_model_path(cfg, run_dir), seed=cfg.run.seed
            )
            trainer = LoraActor(model, ActorSettings.from_config(cfg))
        else:
            trainer = Actor(model, ActorSettings.from_config(cfg))
        if cfg.engine.type == "torch":
            engine = make_engine(cfg, model, tokenizer)
            if cfg.model.selfcheck:
                try:
                    run_selfcheck(model, engine, cfg.train)
                except BaseException:
                    engine.close()
                    raise
        else:  # vllm / sglang servers, in their own processes
            engine = server_engine(cfg, model, tokenizer, run_model_path(cfg, run_dir), run_dir)
            if cfg.engine.urls:  # attached servers may hold other weights: load the trainer's
                engine.update_weights_sync(trainer.weights(), 0)
    adapters = None
    if ray_parts is None and cfg.lora.enabled and cfg.lora.sync == "adapter":
        from weir.sync.adapter_sync import LocalAdapterSync  # LoRA adapters alone to vLLM

        adapters = LocalAdapterSync(trainer, engine, run_dir / "engine" / "adapters")
        adapters.push(0)
    try:
        if scored is None:
            scored = reward_function(cfg, reward)
        parts = _components(
            cfg, model, tokenizer, engine, trainer, ray_parts, scored, rollout, filter, run_dir
        )
        parts.policies = policies
        if adapters is not None:
            parts.sync = adapters
        return parts
    except BaseException:
        if ray_parts is not None:
            ray_parts.shutdown()
        if policies is not None:
            policies.engine.close()
        raise


def separate_policies(cfg: Config) -> bool:
    """multi_agent.policies=separate: a policy (model, trainer, engine) per role."""
    return bool(cfg.multi_agent.roles) and cfg.multi_agent.policies == "separate"


def make_critic(cfg: Config, model: torch.nn.Module, run_dir: Path) -> Critic | None:
    """PPO's critic when algo.advantage=gae in one process, else None (on Ray each trainer rank
    holds its shard of the critic, weir.train.rank_build)."""
    if cfg.algo.advantage != "gae":
        return None
    return policy_critic(cfg, model, run_dir)


def policy_critic(cfg: Config, model: torch.nn.Module, run_dir: Path) -> Critic:
    """The critic of the policy `model`: its own copy of the policy's initial backbone (of the
    base model without adapters for LoRA, as trainer ranks build it), `critic.model_path`'s, or
    with `critic.shared_backbone` the policy's own."""
    from weir.train.lora import is_lora, merged_model

    settings = CriticSettings.from_config(cfg)
    if is_lora(model) and not settings.critic.shared_backbone:
        model = merged_model(model)  # B = 0 at the start: the base model's weights, no adapters
    build_dir = run_dir.parent / ".models"
    value_model = load_value_model(
        settings, model, build_dir, arch=cfg.model.arch, seed=cfg.model.init_seed
    )
    return Critic(value_model, settings)


def _check_vision_run(cfg: Config) -> None:
    """Refuse, before any work, the parts of a run that would drop a VLM's images."""
    if separate_policies(cfg):
        raise ValueError(
            "multi_agent.policies=separate with a vision-language model: the multi-agent rollout "
            "builds every role's view from the turns' text and carries no images, so the policies "
            "would train on prompts without their pictures; use a text model (docs/multimodal.md)"
        )
    if cfg.engine.process:
        raise ValueError(
            "a vision-language model's engine runs in the trainer's process: set "
            "engine.process=false (docs/multimodal.md)"
        )
    if cfg.engine.type != "torch":
        raise ValueError(
            f"a vision-language model with engine.type={cfg.engine.type}: weir sends a server "
            "token ids over its completions endpoint, which carries no images, so the server "
            "would not see what weir's processor placed in the prompt; use engine.type=torch "
            "(docs/multimodal.md)"
        )
    if "multi_agent" in cfg.rollout.function:
        raise ValueError(
            "multi-agent episodes do not carry images yet; use the multi-turn rollout "
            "(weir.rollout.multi_turn:rollout) with a vision-language model (docs/multimodal.md)"
        )


def _components(
    cfg, model, tokenizer, engine, trainer, ray_parts, reward_fn, rollout, filter, run_dir
):
    if ray_parts is not None and ray_parts.reward_pool is not None:
        reward_fn = ray_parts.reward_pool.reward  # scored in cluster.reward_workers actors
    ctx, eval_ctx = make_contexts(cfg, engine, tokenizer, reward_fn)
    spec = filter or cfg.rollout.filter
    return Components(
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        trainer=trainer,
        prompts=PromptSource(
            task_rows(cfg, "train"),
            seed=cfg.run.seed,
            shuffle=cfg.data.shuffle,
            epochs=cfg.data.epochs,
        ),
        eval_rows=task_rows(cfg, "test"),
        ctx=ctx,
        eval_ctx=eval_ctx,
        rollout_fn=resolve(rollout or cfg.rollout.function, {}, "rollout.function"),
        keep=resolve(spec, {}, "rollout.filter") if spec else None,
        sync=ray_parts.sync if ray_parts is not None else None,
        cluster=ray_parts,
        critic=make_critic(cfg, model, run_dir) if ray_parts is None else None,
        eval_breakdown=cfg.eval.breakdown,
    )
