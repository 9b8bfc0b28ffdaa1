"""The sections of the config tree, one model per top-level key (run, model, data, ...) plus their
sub-sections. Every field has a default, a range where one makes sense, and a docstring;
`weir.config.schema.Config` assembles them and checks what spans sections.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


def _off(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` (in a file or a `key=off` override) as false: take it as "off"."""
    return "off" if value is False else value


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class RunConfig(Section):
    name: str = "weir"
    """Run name, used in logs and the default run directory."""
    dir: str | None = None
    """Run directory (config, metrics.jsonl, checkpoints, final model). Default: runs/<name>."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    steps: int = Field(20, ge=0)
    """Number of RL steps (one batch of prompts each)."""
    eval_every: int = Field(5, ge=0)
    """Evaluate on the held-out split every N steps (0: only before and after training)."""
    save_model: bool = True
    """Write the trained model as a standard HF directory to <dir>/model at the end."""
    overwrite: bool = True
    """Reuse an existing run directory (metrics.jsonl is rewritten) when not resuming from it."""
    checkpoint_every: int = Field(10, ge=0)
    """Write a checkpoint every N steps and at the end (0: never). A stop signal also writes one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Keep the newest K checkpoints in <dir>/checkpoints; older ones are deleted."""
    resume: str = "auto"
    """`auto`: continue from the newest complete checkpoint in <dir>/checkpoints if there is one;
    `never`: start from scratch (old checkpoints are deleted); or the path of one checkpoint."""
    checkpoint_verify: Literal["full", "sampled"] = "full"
    """How a checkpoint is checked before resuming from it: `full` re-hashes every byte (SHA-256;
    catches any corruption, reads the whole checkpoint: about a minute for a 7B fp32 run's 84 GB);
    `sampled` checks sizes and 16 blocks of 64 KiB per file (instant; catches truncated and torn
    writes, not a bit flip outside the samples). See docs/checkpoints.md."""
    deterministic: bool = False
    """Same seed and config give byte-identical metrics.jsonl (sync loop): deterministic torch kernels,
    and wall-clock figures (time/*, throughput/*) go to timings.jsonl instead."""


class ModelConfig(Section):
    path: str = "tiny:tiny"
    """HF model directory or hub name; `tiny:<size>` builds weir's tiny model (nano, tiny, small)."""
    arch: Literal["qwen3", "llama"] = "qwen3"
    """Architecture of a `tiny:` model."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """Deprecated: use train.param_dtype, train.compute_dtype and engine.dtype. When set, it is the
    parameter dtype of the trainer and the built-in engine, as before."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads (default: torch's choice)."""
    init_seed: int = 0
    """Seed for the random init of a `tiny:` model."""
    selfcheck: bool = True
    """At start-up, compare packed with unpacked and engine with trainer log-probs on the model
    (docs/models.md); on a packing mismatch fall back to `train.packing=padded`, else stop."""
    cudnn_attention: bool = False
    """Let PyTorch's SDPA attention run on cuDNN (CUDA only; process-wide, in the trainer and the
    built-in engine). Off by default: torch sends attention with a mask to cuDNN first on Hopper
    and newer GPUs, and cuDNN builds an execution plan for every new shape (each decode step's
    longer KV, each new padded length), milliseconds to a second each; off, SDPA uses its flash and
    memory-efficient kernels, which need no plan. See docs/gpu.md."""


class DataConfig(Section):
    task: str | None = "arithmetic"
    """Built-in task (arithmetic, countdown, gsm8k) providing data and reward; null to use `source`."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """Task options, e.g. {digits: 2} for arithmetic or {data_dir: ...} for gsm8k."""
    source: str | None = None
    """Training prompts: a JSONL/Parquet file, a `datasets` directory, or a dotted path to an iterable."""
    eval_source: str | None = None
    """Held-out prompts (same formats). Default: the task's test split."""
    train_size: int = Field(20000, ge=1)
    """Rows generated for a synthetic task's train split."""
    eval_size: int = Field(500, ge=1)
    """Held-out rows used by evaluation: N rows of a task's test split, or the first N rows of
    `eval_source`."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt text (or use `messages`)."""
    answer_key: str = "answer"
    """Field of a row holding the ground truth passed to the reward."""
    system_prompt: str | None = None
    """System message prepended when the chat template is used."""
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Longer prompts are handled per `on_long_prompt`."""
    on_long_prompt: Literal["skip", "truncate", "error"] = "skip"
    """`skip` drops and counts over-long prompts; `truncate` cuts their first tokens (keeping the
    assistant cue at the end) and counts them; `error` stops the run."""
    shuffle: bool = True
    """Shuffle prompts each epoch, deterministically by seed."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the training prompts; the run ends early when they are used up. null: no limit."""


class RolloutConfig(Section):
    function: str = "weir.rollout.single_turn:rollout"
    """`async (ctx, row) -> Group`: how one prompt becomes a group of samples."""
    n: int = Field(8, ge=1)
    """Responses per prompt (group size)."""
    batch_prompts: int = Field(32, ge=1)
    """Prompts per RL step."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; the trainer scales logits by the same value."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1 disables."""
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest response; longer ones end with status `truncated`."""
    filter: str | None = None
    """`(group) -> bool` keeping a group; e.g. `weir.rollout.filters:nonzero_std` (DAPO dynamic sampling)."""
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Stop the run when more than this fraction of a step's samples failed."""


class RewardComponent(Section):
    function: str
    """Reward name (a built-in, reward_model, judge, combine) or dotted path."""
    weight: float = 1.0
    """Its weight in the total reward."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to it."""
    name: str | None = None
    """Its name in reward_info and in the metrics reward/<name>; default: the function's name."""
    on_error: Literal["fail", "zero"] = "fail"
    """A failure fails the sample (fail) or scores 0 and counts in reward/<name>_failed (zero)."""


class RewardConfig(Section):
    function: str | None = None
    """Reward name (exact_match, numeric, math, format, reward_model, judge, combine) or dotted path; default: the task's reward."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the reward function."""
    timeout_s: float | None = Field(30.0, gt=0)
    """A reward call taking longer fails that sample."""
    components: list[RewardComponent] = Field(default_factory=list)
    """Weighted sum of rewards (docs/reward-models.md); when set, function must be unset or combine."""


class KLConfig(Section):
    coef: float = Field(0.0, ge=0.0)
    """KL-to-reference coefficient; 0 disables the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators: k1 = log r, k2 = (log r)^2/2, k3 = r - 1 - log r."""
    as_reward: bool = False
    """Subtract coef * KL from per-token rewards instead of adding it to the loss."""
    adaptive_target: float | None = Field(None, gt=0)
    """Adapt the coefficient toward this KL per token (Ziegler et al. 2019); only with as_reward."""
    adaptive_horizon: int = Field(10000, ge=1)
    """Samples over which the adaptive coefficient moves by its full proportional error."""


class CorrectionConfig(Section):
    preset: (
        Literal[
            "tis", "seq_tis", "geo_tis", "token_mask", "icepop", "seq_mask", "seq_mis", "geo_mask"
        ]
        | None
    ) = None
    """A named correction with its published band (docs/algorithms.md, "Presets"); it stands for
    mode, cap, low, high and seq_ratio (weir.algo.correction_presets), and a key also set here
    explicitly keeps the explicit value."""
    mode: Literal[
        "none", "token_tis", "seq_tis", "token_mask", "seq_mask", "token_mis", "seq_mis"
    ] = "none"
    """Correction of the engine/trainer log-prob mismatch (truncated importance sampling or masking)."""
    cap: float = Field(2.0, gt=0)
    """Truncation cap C for TIS weights."""
    low: float = Field(0.5, ge=0)
    """Masking modes drop tokens / sequences whose trainer/engine ratio is below this."""
    high: float = Field(2.0, gt=0)
    """Masking modes drop tokens / sequences whose trainer/engine ratio is above this."""
    seq_ratio: Literal["product", "geometric"] = "product"
    """The sequence-level modes' ratio: the product of the token ratios (the likelihood ratio) or
    their geometric mean (length-normalised)."""

    @property
    def active(self) -> bool:
        """Whether a correction (a preset or a mode) is configured."""
        return self.preset is not None or self.mode != "none"


class DistillConfig(Section):
    """On-policy distillation (docs/distillation.md): a teacher scores the student's own sampled
    tokens and the per-token reverse KL ``log pi_student - log pi_teacher`` trains the student."""

    teacher: str | None = None
    """null: off. `reference`: the reference model (the initial policy, as for algo.kl); a model
    directory or `tiny:<size>` (loaded like the policy, scored in batches by the trainer with its own
    kernels; it must share the policy's tokenizer); or the base URL of an OpenAI-compatible server
    (`http://host:port`, e.g. `vllm serve`) whose /v1/completions returns the log-probs of given
    prompt token ids (`echo` with `logprobs`, or vLLM's `prompt_logprobs`); a server that cannot is
    refused at start-up."""
    coef: float = Field(1.0, gt=0.0)
    """Weight c of the reverse KL: advantage ``-c * (log pi - log q)`` per token, or loss term
    ``c * agg(sg(log pi - log q) log pi)``."""
    reward_weight: float = Field(0.0, ge=0.0)
    """Weight of the task reward's advantage (algo.advantage on the rewards) added to the
    distillation advantage; 0 distils alone, the reward then only shows in the metrics."""
    mode: Literal["advantage", "loss"] = "advantage"
    """`advantage`: the dense per-token advantage goes through the policy loss (its ratio and clip);
    `loss`: a separate term of the loss with the same gradient at ratio 1, not clipped."""
    teacher_temperature: float = Field(1.0, gt=0.0)
    """Temperature of the teacher's log-probs (1: its own distribution)."""
    endpoint_model: str | None = None
    """A served teacher: the model name to ask for (default: the first of its /v1/models)."""
    endpoint_concurrency: int = Field(8, ge=1)
    """A served teacher: requests in flight at once (one per sample)."""
    endpoint_timeout_s: float = Field(120.0, gt=0)
    """A served teacher: the longest one request may take."""


class CreditConfig(Section):
    """How a multi-turn episode's step-wise (action-level) rewards and its task-level reward become
    advantages (docs/algorithms.md#rewards-at-two-levels)."""

    mode: Literal["episode", "turn", "both"] = "episode"
    """`episode`: every token of an episode gets the advantage of its reward (agent.reward).
    `turn`: the tokens of turn t get the group-relative advantage of the return to go of the
    environment's step rewards, G_t = sum_{t'>=t} step_discount^(t'-t) r_t'. `both`: the task
    reward's advantage plus step_weight times the turn term (A = A^E + w A^S). With gae /
    reinforce_pp the step rewards are placed on each turn's last token instead."""
    step_weight: float = Field(1.0, ge=0.0)
    """w, the weight of the step-level term under mode=both (and of the step rewards for gae)."""
    step_discount: float = Field(1.0, ge=0.0, le=1.0)
    """gamma over turns in the return to go of the step rewards."""


class AlgoConfig(Section):
    advantage: str = "grpo"
    """grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, or a dotted path."""
    advantage_options: dict[str, Any] = Field(default_factory=dict)
    """e.g. {norm_by_std: false} for Dr.GRPO, {gamma: 1.0}."""
    policy_loss: str = "ppo"
    """ppo, gspo, cispo, reinforce, decoupled_ppo, or a dotted path."""
    loss_options: dict[str, Any] = Field(default_factory=lambda: {"eps_low": 0.2, "eps_high": 0.28})
    """Options of the policy loss (clip bounds, dual clip, ...)."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (see docs/algorithms.md)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    kl: KLConfig = Field(default_factory=KLConfig)
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    """Old-policy log-probs: recomputed by the trainer before the update, or the engine's."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    """Step-wise and task-level rewards of multi-turn episodes into advantages."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    routing_replay: bool = False
    """Routing replay (R3) for mixture-of-experts models (Qwen3-MoE, GPT-OSS, DeepSeek-V3): the
    built-in engine records the experts every MoE layer picks for each prompt and generated token,
    and the trainer's forwards (old, new and reference log-probs) use them instead of their own
    routers' picks, with the gate weights recomputed from the trainer's router logits (docs/models.md)."""
    behavior_logprobs: Literal["sampled", "full"] = "sampled"
    """The behaviour policy that algo.correction and decoupled PPO weigh against when
    rollout.top_k / rollout.top_p truncate sampling: `sampled`, the log-probs under the truncated,
    renormalised distribution the engine drew each token from (the distribution that produced the
    data), or `full`, the full-vocabulary log-probs (off by log of the kept mass per token; a warning
    says so). The two are equal when no filter applies."""


class TrainConfig(Section):
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine schedule floor as a fraction of lr."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm; null disables."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per RL step: the batch is split into this many mini-batches."""
    epochs: int = Field(1, ge=1)
    """Passes over the RL batch (PPO epochs)."""
    micro_batch_tokens: int = Field(8192, ge=16)
    """Token budget of one packed forward/backward (gradient accumulation beyond it)."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Trainer device: `auto` (CUDA when present, else CPU), `cpu`, `cuda` or `cuda:N`."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the master weights, gradients and AdamW state. `auto`: float32 (bf16 parameters
    lose updates below bf16's resolution, e.g. most of an lr 1e-6 step)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the forward/backward matmuls (autocast locally, FSDP2 MixedPrecisionPolicy on Ray).
    `auto`: bfloat16 on CUDA, float32 on CPU."""
    mixed_precision: Literal["auto", "autocast", "compute_copy"] = "auto"
    """How one trainer process computes in a `compute_dtype` narrower than its float32 masters:
    `autocast` (torch.autocast: float32 residual stream, each linear casts its input and weight);
    `compute_copy` (forward and backward on a bf16 copy of the weights made at each update, bf16
    residual stream, gradients accumulated into the float32 masters: FSDP2's mixed precision, which
    Ray ranks always use; +2 bytes per parameter during a step; docs/trainer-step.md); `auto`:
    compute_copy on CUDA, autocast elsewhere."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    less memory for about one more forward's compute."""
    offload_optimizer: bool = False
    """Keep AdamW's moments in CPU memory and step there (frees 8 bytes per parameter on the GPU at
    the cost of a device-host copy of parameters and gradients per optimizer step)."""
    logprob_chunk_tokens: int = Field(256, ge=1)
    """Response tokens per chunk of the log-prob / entropy computation: at most this many rows of
    vocabulary-sized float32 temporaries exist at once."""
    logprob_kernel: Literal["auto", "compiled", "eager", "triton", "reference"] = "auto"
    """How the log-probs and entropy are computed from the logits: one fused pass per chunk, run
    through `torch.compile` (`compiled`: CUDA with Triton and a C compiler) or as plain tensor code
    (`eager`); `auto` compiles where it can, else runs eager; `triton`: two hand-written Triton
    kernels over all the rows at once, no chunks (CUDA with a C compiler, or TRITON_INTERPRET=1);
    `reference` runs the two separate reference functions (slower; for checking). All give the
    same numbers up to float rounding (docs/trainer-step.md)."""
    dead_rows: Literal["skip", "forward"] = "skip"
    """Rows whose gradient is exactly zero (every trained token has advantage 0: a GRPO group of
    equal rewards, a masked-out sample; built-in losses without entropy bonus or KL-in-loss only):
    `skip` runs no forward for them when the step has rows that train (the same update; the
    entropy, policy and mismatch metrics then cover the trained rows; a step of such rows only
    runs their forward, so every step has those metrics); `forward` always runs them without
    gradients so those metrics cover every row (docs/trainer-step.md)."""
    packing: Literal["auto", "packed", "padded", "prefix", "varlen"] = "auto"
    """`packed`: concatenate a micro-batch's sequences into one row; `varlen`: the same row through
    a variable-length attention kernel, no mask (torch's FlashAttention-2 on CUDA, SDPA per sequence
    elsewhere); `padded`: one padded row per sequence; `prefix`: sequences sharing a prompt (a GRPO
    group) run it once, their responses on its KV cache; `auto`: packed with a FlashAttention
    backend, else for RL the cheapest of prefix, varlen and padded for each step's lengths among
    those a start-up probe finds exact (docs/trainer-step.md), else padded."""
    memory: Literal["fixed", "plan"] = "fixed"
    """`plan`: on a GPU, choose `gradient_checkpointing` (off where the activations fit) and
    `micro_batch_tokens` (the largest power of two from 4096 to 65536 that fits) at start-up from a
    memory model of the activations per token and the free GPU memory; logged. `fixed`: as set."""
    fuse: Annotated[Literal["auto", "liger", "compile", "off"], BeforeValidator(_off)] = "auto"
    """Fused element-wise kernels in the decoder (RMSNorm, RoPE, SiLU x up): `compile` (regional
    torch.compile of each decoder layer; needs a C compiler), `liger` (Liger's Triton kernels, CUDA,
    `weir[liger]`), `auto` (compile where it can run, else liger, on CUDA; off on a CPU, an FSDP2
    rank and a LoRA model), `off`. A route that cannot run falls back to the next and says so once
    (docs/trainer-step.md)."""


class CriticConfig(Section):
    """The learned critic (value model) of PPO; built when algo.advantage is gae (docs/critic.md)."""

    model_path: str | None = None
    """HF model directory or `tiny:<size>` whose backbone becomes the value model (its LM head is
    dropped, a value head added); it must use the policy's tokenizer. null: the policy's initial
    model (model.path)."""
    shared_backbone: bool = False
    """Put the value head on the policy's own backbone instead of a separate model: no second
    model in memory, but the critic's updates also move the policy's backbone."""
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate of the critic's AdamW."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine schedule floor as a fraction of critic.lr."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the critic's global gradient norm; null disables."""
    freeze_actor_steps: int = Field(0, ge=0)
    """Critic warm-up: the first N RL steps train only the critic; the policy is not updated."""
    value_clip: float | None = Field(0.5, gt=0)
    """Clip range c of the value loss: the new prediction moves at most c from the one GAE used
    before the larger of the clipped and unclipped squared errors is taken; null: no clipping."""
    loss_coef: float = Field(1.0, gt=0.0)
    """Coefficient of the value loss (0.5 * coef * squared error, token mean)."""
    mini_batches: int | None = Field(None, ge=1)
    """Critic optimizer steps per RL step; null: train.mini_batches."""
    epochs: int | None = Field(None, ge=1)
    """Critic passes over the RL batch; null: train.epochs."""


class EngineConfig(Section):
    type: Literal["torch", "vllm", "sglang"] = "torch"
    """Inference engine: `torch` (built in), `vllm` or `sglang` (servers; see docs/engines.md)."""
    max_batch_size: int = Field(256, ge=1)
    """Rows decoded together by the built-in engine."""
    share_weights: bool = True
    """Colocated: the built-in engine runs on the trainer's own module (no weight copy) when device
    and dtype are the trainer's; otherwise it keeps its own copy."""
    process: bool = False
    """Run the built-in engine in a child process of its own (weights passed through shared
    memory, or CUDA IPC, at each update) instead of a thread of the trainer's process, so that in
    loop.mode=async neither side's Python waits for the other's GIL. Its own copy of the model;
    text models with cluster.type=local (Ray replicas are processes already); `weir serve`, with no
    trainer beside its engine, ignores it. See docs/async.md."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Built-in engine device: `auto` (the trainer's device locally; CUDA when present on a Ray
    replica), `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Built-in engine weight dtype. `auto`: bfloat16 on CUDA, float32 on CPU."""
    kv_budget_gb: float | None = Field(None, gt=0)
    """Most KV cache the engine holds at once, in GiB (2 x layers x kv_heads x head_dim x dtype
    bytes per token of each sequence, prefill and scratch included; activations not counted).
    Built-in engine: requests wait for room; one that can never fit fails with a message; null: no
    limit. vLLM: --kv-cache-memory-bytes on a GPU, VLLM_CPU_KVCACHE_SPACE (whole GiB, default 1)
    on a CPU. SGLang: --max-total-tokens of that size."""
    kv_budget_fraction: float | None = Field(None, gt=0, le=1)
    """Instead of kv_budget_gb. Built-in engine: this fraction of the device memory free when the
    engine starts (CUDA: torch.cuda.mem_get_info after the model is loaded; CPU: available RAM).
    vLLM: --gpu-memory-utilization; SGLang: --mem-fraction-static (their meaning: the share of the
    whole GPU for weights and KV cache)."""
    kv_idle_release_s: float | None = Field(10.0, ge=0)
    """Give the KV cache back after the engine has been idle this many seconds; null keeps it."""
    prefix_cache: bool = True
    """Built-in engine: keep the KV of each finished model turn of a multi-turn episode (and of an
    OpenAI-server session) and reuse it for the next turn, which then prefills only the new tokens
    instead of the whole conversation. Entries count against the KV budget and are dropped on a
    weight update, a sleep or an idle release; see docs/engine-memory.md."""
    share_prefixes: bool = True
    """Built-in engine: compute once a prefix that the prompts prefilled together share (the
    episodes of one prompt, a system message every prompt opens with; and the rows whose KV is
    rebuilt after a weight update), when that saves at least 15% of the prefill's tokens. Off:
    every sequence is prefilled whole (its numbers then differ only by rounding)."""
    cuda_graphs: bool = True
    """Built-in engine on a CUDA device, Llama-family models: replay each decode step as a CUDA
    graph (one launch instead of some 10-20 kernels per layer; rows padded to powers of two, the
    attention over the KV slabs' whole width). Checked against the eager step on its first use
    (rounding only, else eager from then on); see docs/gpu.md. No effect on a CPU."""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """Built-in engine, responses in flight across a weight update (async): `recompute` their KV
    cache under the new weights (one batched prefill of each row's context), so every later token
    is sampled from the new policy on the whole context and its log-prob is exactly the new
    policy's; or `keep` the KV the old weights computed (no prefill: later tokens attend to keys and
    values of the old weights, so their log-probs are not exactly the new policy's; `mismatch/*`
    shows by how much). vllm/sglang always recompute: a request resumes as a new one. See
    docs/async.md."""
    sleep_while_training: bool = True
    """Sync loop, and async with loop.placement=colocated: the engine frees its KV cache while the
    trainer trains (requests in flight keep their tokens; their KV is rebuilt on wake)."""
    sleep_offload_weights: bool = False
    """While asleep, also park the engine's weights in host memory. Only when the engine has its own
    copy (share_weights=false, loop.mode=async, or another device or dtype than the trainer's); a
    shared module stays where it is."""

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineConfig:
        if self.kv_budget_gb is not None and self.kv_budget_fraction is not None:
            raise ValueError(
                "set engine.kv_budget_gb or engine.kv_budget_fraction, not both (null the other)"
            )
        if self.kv_on_update == "keep" and self.type != "torch":
            raise ValueError(
                f"engine.kv_on_update=keep is for the built-in engine: a {self.type} server resumes "
                "a request under new weights by prefilling it again; set engine.kv_on_update=recompute"
            )
        if self.process and self.type != "torch":
            raise ValueError(
                f"engine.process=true is for the built-in engine (a {self.type} server already runs "
                "in its own process); set engine.process=false"
            )
        if self.type == "torch" and self.replicas > 1 and not self.process:
            raise ValueError(
                f"engine.replicas={self.replicas} runs each built-in engine in a process of its "
                "own: set engine.process=true (on Ray: cluster.engines.replicas)"
            )
        return self

    python: str | None = None
    """vllm/sglang: the Python that runs the servers (its own environment); default .venv-vllm."""
    urls: list[str] = Field(default_factory=list)
    """vllm/sglang: attach to servers already running at these base URLs instead of starting any."""
    replicas: int = Field(1, ge=1)
    """vllm/sglang: servers weir starts. Built-in engine (with engine.process=true): engine
    processes, each with its own copy of the weights, e.g. one per core of a CPU machine
    (`weir.engine.local_replicas`; each decodes on loop.engine_threads torch threads in async,
    else on its share of the run's, model.threads // replicas). Either way each prompt goes to
    the one with the fewest outstanding."""
    max_model_len: int | None = Field(None, ge=16)
    """vllm/sglang: context limit of the servers (prompt + response); default: the model's own."""
    sleep_mode: bool = False
    """vllm/sglang: free the servers' memory (sleep) while the trainer trains; wake for rollout."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """vllm/sglang: how long a server may take to answer its health check."""
    request_timeout_s: float = Field(600.0, gt=0)
    """vllm/sglang: a stream silent this long counts as a dead server (restarted, sample retried)."""
    extra_args: list[str] = Field(default_factory=list)
    """vllm/sglang: extra command-line arguments of every server weir starts."""


class EvalConfig(Section):
    temperature: float = Field(0.0, ge=0.0)
    """0 is greedy."""
    n: int = Field(1, ge=1)
    """Samples per prompt (pass@k uses k <= n)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Default: rollout.max_new_tokens."""
    breakdown: str | None = None
    """A row field (e.g. the shapes task's `question`): eval also reports the accuracy per value of
    it as `eval/<field>/<value>/accuracy`, and `weir demo` prints it before and after RL."""


class SFTConfig(Section):
    data: str | None = None
    """JSONL/Parquet of {prompt, response}; default: the task's SFT generator."""
    rows: int = Field(4000, ge=1)
    """Rows generated from the task when `data` is null."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the task's SFT generator, on top of data.task_options (e.g. {corrupt: 0.7})."""
    epochs: int = Field(1, ge=1)
    """Passes over the SFT rows."""
    batch_size: int = Field(64, ge=1)
    """Examples per optimizer step."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (AdamW, betas 0.9/0.95)."""
    warmup_steps: int = Field(10, ge=0)
    """Optimizer steps of linear warm-up."""
    schedule: Literal["constant", "cosine"] = "cosine"
    """Decay after warm-up (cosine floors at 5% of lr)."""


class LoopConfig(Section):
    mode: Literal["sync", "async"] = "sync"
    """`sync`: generate, then train, then generate. `async`: rollout never waits for the trainer."""
    max_staleness: int = Field(1, ge=0)
    """Async: a group admitted at weight version v is trained at version <= v + max_staleness (0 = sync)."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """Async: `disaggregated` runs engine and trainer at once on separate threads/cores;
    `colocated` pauses the engine while the trainer trains (time-sliced)."""
    on_weight_update: Literal["continue", "abort", "mask_stale", "finish"] = "continue"
    """Async, for responses in flight when new weights arrive: `continue` under the new weights (each
    token keeps its version), `abort` and regenerate from scratch, keep the prefix but `mask_stale`
    tokens (those from older versions than the sample's newest) out of the loss, or `finish` them
    under the weights they started with: the update waits until they are done, admitting nothing
    new meanwhile, so every response is one version's and no KV is rebuilt (best with
    loop.max_staleness=1, where the trainer needs those responses next anyway). See docs/async.md."""
    finish_timeout_s: float | None = Field(None, gt=0)
    """With on_weight_update=finish: the longest an update waits for the responses in flight. Those
    still running then go on under the new weights as with `continue` (engine.kv_on_update says
    what happens to their KV) and `async/drain_timeouts` counts it. null: wait as long as they run."""
    engine_threads: int | None = Field(1, ge=1)
    """Async: torch intra-op threads of the engine thread."""
    trainer_threads: int | None = Field(1, ge=1)
    """Async: torch intra-op threads of the trainer."""


class TelemetryConfig(Section):
    console: bool = True
    """Show step progress and metrics on the console."""
    progress: Literal["auto", "live", "lines"] = "auto"
    """Console style: `live` is a progress display (step x/N, ETA, reward, length, tokens/s, time
    split) redrawn in place; `lines` prints one line per step (CI logs, files); `auto` picks `live`
    on a terminal and `lines` otherwise."""
    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = False
    """Write TensorBoard event files to <run dir>/tensorboard (pip install 'weir[tensorboard]')."""
    wandb: bool = False
    """Log step metrics to Weights & Biases under <run dir>/wandb (pip install 'weir[wandb]')."""
    wandb_project: str = "weir"
    """W&B project name; the run is named after run.name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` writes locally and never touches the network (upload later with `wandb sync`)."""
    dump_rollouts: bool = False
    """Write each step's samples (ids, text, rewards, log-probs, versions) to rollouts/step_N.jsonl."""
    trace: bool = True
    """Write trace.json (Chrome trace: generate, reward, train, sync, wait, eval spans) for Perfetto."""


class ClusterTrainerConfig(Section):
    ranks: int = Field(1, ge=1)
    """Trainer ranks (one FSDP2 process group; gloo on CPU, NCCL on GPU); > 1 needs cluster.type=ray."""
    cpus_per_rank: float = Field(1.0, ge=0)
    """Ray CPUs reserved per trainer rank (logical resources)."""
    gpus_per_rank: float = Field(0.0, ge=0)
    """Ray GPUs per trainer rank; > 0 trains on CUDA with NCCL."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray custom resources per rank, e.g. {trainer_node: 1} to pin ranks to labelled nodes."""


class ClusterEnginesConfig(Section):
    replicas: int = Field(1, ge=1)
    """Engine replicas (Ray actors behind one router); > 1 needs cluster.type=ray."""
    cpus: float = Field(1.0, ge=0)
    """Ray CPUs per engine replica."""
    gpus: float = Field(0.0, ge=0)
    """Ray GPUs per engine replica."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray custom resources per replica, e.g. {engine_node: 1}."""
    max_restarts: int = Field(2, ge=0)
    """How often Ray restarts a replica that died; it rejoins with the current weights."""


class ClusterConfig(Section):
    type: Literal["local", "ray"] = "local"
    """local: one process (engine and trainer in threads); ray: trainer ranks and engines as Ray actors."""
    address: str | None = None
    """Ray cluster to join (`auto` for the cluster `ray start` made on this node); None starts a local one."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of a Ray instance started here (address None); None lets Ray count the cores."""
    trainer: ClusterTrainerConfig = Field(default_factory=ClusterTrainerConfig)
    """Trainer ranks and their resources."""
    engines: ClusterEnginesConfig = Field(default_factory=ClusterEnginesConfig)
    """Engine replicas and their resources."""
    colocate: bool = False
    """Place each engine replica in a trainer rank's bundle (sharing its CPUs/GPUs) instead of its own."""
    weight_sync: Literal["auto", "broadcast", "disk", "object_store"] = "auto"
    """Transport of new weights to Ray engines: broadcast (streamed from the trainer's shards bucket
    by bucket: torch.distributed, CUDA IPC / shared memory for engines on rank 0's device), disk
    (safetensors), or object_store (Ray's); auto = broadcast. disk and object_store gather the full
    weights on rank 0."""
    sync_dir: str | None = None
    """Directory of the disk transport (shared by trainer and engines); default <run dir>/weights."""
    bucket_mb: float = Field(64.0, gt=0)
    """Size of one broadcast bucket of the weight sync."""
    verify_sync: bool = False
    """After every weight sync on Ray, check that each engine holds exactly the trainer's weights:
    a hash of the tensors the engine loaded (weir's engine: its own; a vLLM worker: those it
    received) against the same hash gathered from the trainer's shards, one tensor at a time. A
    difference stops the run; `sync/verified` is 1 per verified sync. Costs a hash of the weights
    on both sides; for checking a new cluster's set-up (NCCL, TP), and in weir's tests."""
    offload_trainer: bool = True
    """With colocate on GPUs: trainer ranks keep parameters, gradients and optimizer state in host
    memory except while they train, so the engines on their GPUs have it to generate."""
    offload_pinned: bool = True
    """With offload_trainer: keep those host copies in pinned (page-locked) memory, so the copies
    both ways run at the link's full speed. torch caches pinned blocks rounded up to a power of
    two, so the host holds up to 2x the offloaded bytes for the whole run; false copies through
    ordinary memory (slower, no extra host memory)."""
    reward_workers: int = Field(2, ge=0)
    """On Ray, score rewards in this many Ray actors (off the driver); 0 scores in driver threads."""


class LoraConfig(Section):
    """LoRA adapters (through peft) instead of training every weight (docs/lora.md)."""

    enabled: bool = False
    """Train low-rank adapters on the target modules; the base weights stay frozen. The engine
    gets the merged weights W + (alpha / rank) B A; checkpoints hold only the adapters."""
    rank: int = Field(8, ge=1)
    """r, the rank of each adapter: A is r x in_features, B is out_features x r."""
    alpha: float = Field(16.0, gt=0)
    """The adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with `rslora`)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Linear layers to adapt: module-name suffixes (e.g. [q_proj, v_proj]) or `all-linear`
    (every linear layer but the output head)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input in the trainer's gradient forward only; old, reference and
    engine log-probs never see it (so with dropout > 0 the first update's ratio is not exactly 1)."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank) instead of alpha / rank."""
    sync: Literal["merged", "adapter"] = "merged"
    """What the engines get after each step: `merged` weights W + s B A under the base model's
    names (any engine; the whole model's bytes), or the `adapter` alone (A and B, a peft adapter
    directory loaded by vLLM's runtime LoRA endpoint, the server started with --enable-lora;
    engine.type=vllm). docs/lora.md compares the bytes each moves."""
