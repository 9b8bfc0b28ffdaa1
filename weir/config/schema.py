"""The typed config tree: `Config`, its sections (`weir.config.sections`) and the checks that span
sections. Every field has a default, a range where one makes sense, and a docstring.

docs/configuration.md is generated from these models (`weir config-docs`), so it never drifts.
"""

from __future__ import annotations

import warnings

from pydantic import Field, model_validator

from weir.config.adapter_sections import (  # noqa: F401
    GymnasiumConfig,
    OpenEnvConfig,
    ReasoningGymConfig,
    TextArenaConfig,
    VerifiersConfig,
)
from weir.config.episode_sections import (  # noqa: F401
    AgentConfig,
    MultiAgentConfig,
    RoleConfig,
    SandboxConfig,
    ServeConfig,
    VisionConfig,
)
from weir.config.sections import (  # noqa: F401  (re-exported: the sections live there)
    DEVICE_PATTERN,
    AlgoConfig,
    ClusterConfig,
    ClusterEnginesConfig,
    ClusterTrainerConfig,
    CorrectionConfig,
    CreditConfig,
    CriticConfig,
    DataConfig,
    DistillConfig,
    EngineConfig,
    EvalConfig,
    KLConfig,
    LoopConfig,
    LoraConfig,
    ModelConfig,
    RewardComponent,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    Section,
    SFTConfig,
    TelemetryConfig,
    TrainConfig,
)


class Config(Section):
    """The whole run. Load from YAML with `load_config`; override with dotted keys."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    multi_agent: MultiAgentConfig = Field(default_factory=MultiAgentConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig)
    gymnasium: GymnasiumConfig = Field(default_factory=GymnasiumConfig)
    openenv: OpenEnvConfig = Field(default_factory=OpenEnvConfig)
    textarena: TextArenaConfig = Field(default_factory=TextArenaConfig)
    verifiers: VerifiersConfig = Field(default_factory=VerifiersConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        self._migrate_model_dtype()
        total = self.rollout.batch_prompts * self.rollout.n
        if total % self.train.mini_batches:
            raise ValueError(
                f"train.mini_batches={self.train.mini_batches} must divide rollout.batch_prompts * rollout.n = {total}"
            )
        adapter_data = self._adapter_data()
        if self.data.task is None and self.data.source is None and not adapter_data:
            raise ValueError("set data.task to a built-in task or data.source to your prompts")
        if self.data.task is None and self.data.eval_source is None and not adapter_data:
            raise ValueError(
                "set data.eval_source to held-out prompts (or data.task to a built-in task)"
            )
        c, kl = self.algo.correction, self.algo.kl
        if c.low >= c.high:
            raise ValueError(
                f"algo.correction.low ({c.low}) must be below algo.correction.high ({c.high})"
            )
        if kl.adaptive_target is not None and not kl.as_reward:
            raise ValueError(
                "algo.kl.adaptive_target adapts the KL reward penalty: also set algo.kl.as_reward=true"
            )
        if (kl.as_reward or kl.adaptive_target is not None) and kl.coef == 0:
            raise ValueError(
                "algo.kl.as_reward / adaptive_target need algo.kl.coef > 0 (the initial coefficient)"
            )
        if self.rollout.temperature == 0 and self.rollout.n > 1:
            raise ValueError(
                "rollout.temperature=0 with rollout.n > 1 samples n identical responses: no group has any "
                "reward spread to learn from; set rollout.temperature > 0"
            )
        if self.eval.temperature == 0 and self.eval.n > 1:
            raise ValueError(
                "eval.n > 1 needs eval.temperature > 0 (greedy samples are identical, pass@k = pass@1)"
            )
        if self.run.deterministic and self.loop.mode != "sync":
            raise ValueError(
                "run.deterministic needs loop.mode=sync (the async loop's batches depend on timing)"
            )
        cl = self.cluster
        if self.engine.type != "torch":
            self._check_server_engine()
        if cl.type == "local" and (cl.trainer.ranks > 1 or cl.engines.replicas > 1):
            raise ValueError(
                "cluster.trainer.ranks / cluster.engines.replicas > 1 need cluster.type=ray "
                "(the local cluster is one process)"
            )
        if cl.type == "ray" and self.run.deterministic:
            raise ValueError(
                "run.deterministic needs cluster.type=local (on Ray the replica serving each request "
                "depends on timing)"
            )
        if self.correction_needs_engine_logprobs and self.rollout.temperature == 0:
            raise ValueError("algo.correction needs sampling: set rollout.temperature > 0")
        self._warn_behavior_logprobs()
        self._check_lora_sync()
        self._check_multi_agent()
        self._check_credit()
        return self

    def _check_credit(self) -> None:
        """algo.credit turn/both: multi-turn episodes, and an estimator the rule knows."""
        credit, advantage = self.algo.credit, self.algo.advantage
        if credit.mode == "episode":
            return
        if self.agent.env is None and "multi_turn" not in self.rollout.function:
            raise ValueError(
                f"algo.credit.mode={credit.mode} needs multi-turn episodes with step rewards: set "
                "rollout.function=weir.rollout.multi_turn:rollout and agent.env"
            )
        known = ("grpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline")
        if advantage not in known:
            raise ValueError(
                f"algo.credit.mode={credit.mode} combines step and task rewards for "
                f"{', '.join(known)}; algo.advantage={advantage!r} is not one of them"
            )

    def _check_lora_sync(self) -> None:
        """lora.sync=adapter needs an engine that applies an adapter per request."""
        if self.lora.enabled and self.lora.sync == "adapter" and self.engine.type != "vllm":
            raise ValueError(
                f"lora.sync=adapter sends only the adapter, which an engine must apply itself at "
                f"every token: vLLM's LoRA support does (engine.type=vllm); engine.type="
                f"{self.engine.type} runs the merged weights: set lora.sync=merged"
            )

    def _adapter_data(self) -> bool:
        """An adapter section that provides the prompts (weir.adapters.adapter_rows)."""
        env = self.agent.env
        return bool(
            self.reasoning_gym.dataset
            or self.textarena.env_id
            or self.verifiers.env
            or (env == "gymnasium" and self.gymnasium.id)
            or (env == "openenv" and self.openenv.env)
        )

    def _warn_behavior_logprobs(self) -> None:
        """Corrections against the full-vocabulary log-probs of a truncated sampler are biased."""
        r, a = self.rollout, self.algo
        truncated = r.top_p < 1.0 or r.top_k > 0
        weighs = a.correction.active or a.policy_loss == "decoupled_ppo"
        if truncated and weighs and a.behavior_logprobs == "full":
            warnings.warn(
                f"algo.behavior_logprobs=full with rollout.top_p={r.top_p} / top_k={r.top_k}: "
                "the corrections weigh against a distribution the engine did not sample from; "
                "set algo.behavior_logprobs=sampled",
                UserWarning,
                stacklevel=2,
            )

    def _check_multi_agent(self) -> None:
        """multi_agent.roles and the multi-agent rollout function go together."""
        ma, fn = self.multi_agent, self.rollout.function
        if fn == "weir.rollout.multi_agent:rollout" and not ma.roles:
            raise ValueError(
                "rollout.function=weir.rollout.multi_agent:rollout needs multi_agent.roles "
                "(e.g. [{name: proposer}, {name: checker}])"
            )
        if ma.roles and fn in (
            "weir.rollout.single_turn:rollout",
            "weir.rollout.multi_turn:rollout",
        ):
            raise ValueError(
                f"multi_agent.roles is set but rollout.function={fn} ignores it; set "
                "rollout.function=weir.rollout.multi_agent:rollout"
            )

    def _migrate_model_dtype(self) -> None:
        """The old `model.dtype` set one dtype for everything; it still does, with a warning."""
        old = self.model.dtype
        if old is None:
            return
        warnings.warn(
            f"model.dtype={old} is deprecated: set train.param_dtype (master weights), "
            "train.compute_dtype (forward/backward) and engine.dtype instead; "
            f"model.dtype={old} now sets those still at auto to {old}",
            FutureWarning,
            stacklevel=2,
        )
        for section, key in (
            (self.train, "param_dtype"),
            (self.train, "compute_dtype"),
            (self.engine, "dtype"),
        ):
            if getattr(section, key) == "auto":
                setattr(section, key, old)

    def _check_server_engine(self) -> None:
        """vLLM / SGLang servers: what weir cannot run exactly with them is refused here."""
        e, r = self.engine.type, self.rollout
        cl = self.cluster
        if cl.type == "ray" and self.engine.replicas > 1:
            raise ValueError(
                f"engine.replicas={self.engine.replicas} with cluster.type=ray: on Ray "
                "cluster.engines.replicas sets how many servers (one Ray actor each); set "
                "engine.replicas=1"
            )
        if cl.type == "ray" and cl.weight_sync == "object_store":
            raise ValueError(
                f"cluster.weight_sync=object_store with engine.type={e}: a {e} server is a process "
                "of its own environment that Ray's object store does not reach; use broadcast "
                "(auto) or disk"
            )
        nccl_on_one_gpu = cl.colocate and cl.trainer.gpus_per_rank > 0 and cl.engines.gpus > 0
        if cl.type == "ray" and nccl_on_one_gpu and cl.weight_sync in ("auto", "broadcast"):
            raise ValueError(
                f"cluster.colocate=true puts {e} servers on the trainer ranks' GPUs, and NCCL "
                "cannot join two processes on one GPU into the weight-broadcast group: set "
                "cluster.weight_sync=disk"
            )
        if cl.type == "ray" and cl.engines.gpus > 1 and cl.engines.gpus != int(cl.engines.gpus):
            raise ValueError(
                f"cluster.engines.gpus={cl.engines.gpus}: a {e} server's tensor parallelism is "
                "its whole GPUs; use a whole number (or a fraction below 1 for a shared GPU)"
            )
        if cl.verify_sync and e == "sglang":
            raise ValueError(
                "cluster.verify_sync with engine.type=sglang: SGLang reports a parameter only "
                "truncated (/get_weights_by_name), so what a server loaded cannot be hashed whole; "
                "set cluster.verify_sync=false"
            )
        if self.engine.urls and self.multi_agent.policies == "separate" and self.multi_agent.roles:
            roles = len(self.multi_agent.roles)
            if len(self.engine.urls) % roles:
                raise ValueError(
                    f"engine.urls lists {len(self.engine.urls)} servers for {roles} separate "
                    "policies: each role takes an equal share, in role order; list a multiple of "
                    f"{roles}"
                )
        if r.top_p < 1.0 or r.top_k > 0:
            raise ValueError(
                f"rollout.top_p / rollout.top_k with engine.type={e}: a {e} server reports one "
                "log-prob per token, of a kind fixed when it starts (vLLM's --logprobs-mode), and "
                "under top-k/top-p weir needs two: the truncated distribution's (the behaviour "
                "policy, algo.behavior_logprobs) and the full vocabulary's (old log-probs, the "
                "mismatch metrics); set rollout.top_p=1.0 and rollout.top_k=0, or use "
                "engine.type=torch, which reports both"
            )
        if self.algo.routing_replay:
            why = {
                "vllm": "weir streams vLLM's /v1/completions, which returns no routed experts (vLLM "
                "returns them from /inference/v1/generate with --enable-return-routed-experts, "
                "which weir does not use)",
                "sglang": "SGLang returns them (--enable-return-routed-experts) but weir's SGLang "
                "adapter, unverified against a live server, does not read them",
            }[e]
            raise ValueError(
                f"algo.routing_replay with engine.type={e}: {why}; use engine.type=torch"
            )

    @property
    def correction_needs_engine_logprobs(self) -> bool:
        return self.algo.correction.active

    @model_validator(mode="after")
    def _check_engine_process(self) -> Config:
        if self.engine.process and self.cluster.type == "ray":
            raise ValueError(
                "engine.process=true moves the built-in engine out of the trainer's process, and on "
                "Ray every engine replica is a process (a Ray actor) of its own already: set "
                "engine.process=false (cluster.engines.replicas sets how many)"
            )
        if self.engine.process and self.engine.replicas > 1 and self.run.deterministic:
            raise ValueError(
                "run.deterministic needs engine.replicas=1: which replica serves a prompt, and so "
                "which rows it is batched with, depends on timing"
            )
        return self

    @model_validator(mode="after")
    def _check_critic(self) -> Config:
        """algo.advantage=gae trains a critic: what it cannot do yet is refused here."""
        if self.algo.advantage != "gae":
            return self
        if self.cluster.type == "ray" and self.critic.shared_backbone:
            raise ValueError(
                "critic.shared_backbone=true on Ray: the value head would run the policy's FSDP2 "
                "layers outside the policy's own forward, where FSDP2 reduces their gradients; "
                "set critic.shared_backbone=false (the critic gets a sharded backbone of its own)"
            )
        mb, total = self.critic.mini_batches, self.rollout.batch_prompts * self.rollout.n
        if mb is not None and total % mb:
            raise ValueError(
                f"critic.mini_batches={mb} must divide rollout.batch_prompts * rollout.n = {total}"
            )
        return self
