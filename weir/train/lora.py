"""LoRA through peft: adapters on the trainer's model, merged weights for the engines.

With ``lora.enabled`` the trainer's module is a `peft.PeftModel`. Every target linear layer computes

    y = x W^T + s * dropout(x) A^T B^T,    s = alpha / r   (alpha / sqrt(r) with rslora)

with the base weight W frozen and A (r x in), B (out x r) trained; B starts at zero, so step 0 is
the base model exactly. Only A and B have gradients and optimizer state.

Engines get merged weights ``W' = W + s B A`` under the base model's own parameter names
(`merged_weights`): the built-in engine runs a plain copy of the base architecture that holds W'
(never the trainer's module), and vLLM / SGLang take the same tensors through the normal weight
sync. Merging rather than running the PeftModel in the engine: one path for every engine, no extra
adapter matmuls per decoded token, and adapter dropout can never touch a sampled token. The price:
``x W'^T`` and ``x W^T + s x A^T B^T`` round differently, so engine and trainer log-probs agree to
float rounding, not bit for bit; ``mismatch/abs_logp_diff`` reports it every step (docs/lora.md).

The KL reference is the base model: the same PeftModel with its adapters switched off
(`AdaptersOff`), so LoRA needs no second copy of the weights for KL. Adapter dropout is active only
in the gradient forward (`LoraActor`); old, reference and engine log-probs never see it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from weir.train.actor import Actor, ActorSettings

if TYPE_CHECKING:
    from peft import PeftModel

    from weir.config.schema import LoraConfig

ADAPTER = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def require_peft() -> ModuleType:
    """peft, or a one-line error naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise ValueError(
            'lora.enabled needs peft: pip install "weir[lora]" (make setup installs it)'
        ) from None
    return peft


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (the trainer's module of a LoRA run). Never imports peft
    (seconds): a model cannot be a peft model before peft was imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a peft adapter (adapter_config.json) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name components of `model`'s linear layers (what target_modules matches)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    )


def apply_lora(
    model: torch.nn.Module, lcfg: LoraConfig, base_path: str | None = None, seed: int = 0
) -> PeftModel:
    """Wrap `model` (in place) with LoRA adapters per `lcfg`; returns the PeftModel.

    A is initialised (peft's Kaiming-uniform; B = 0) from `seed` alone, whatever the global RNG
    went through before (e.g. building a `tiny:` model), and the global RNG is left as it was.
    `base_path` is recorded as the adapter's base model (adapter_config.json), where `weir export`
    finds the weights to merge into; a local directory is made absolute. Target modules that match
    nothing, match a layer that is not an `nn.Linear`, or a layer whose weight is tied to another
    (the merge would change both), are refused.
    """
    peft = require_peft()
    targets = lcfg.target_modules
    config = peft.LoraConfig(
        r=lcfg.rank,
        lora_alpha=lcfg.alpha,
        lora_dropout=lcfg.dropout,
        target_modules=targets,
        use_rslora=lcfg.rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if base_path is not None:
        local = Path(base_path).expanduser()
        config.base_model_name_or_path = str(local.resolve()) if local.is_dir() else base_path
    available = linear_names(model)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
            torch.manual_seed(seed)
            peft_model = peft.get_peft_model(model, config)
    except ValueError as err:
        raise ValueError(
            f"lora.target_modules={targets}: {str(err).splitlines()[0]} "
            f"(this model's linear layers: {', '.join(available)})"
        ) from None
    shared = _shared_parameters(peft_model)
    for name, layer in lora_layers(peft_model):
        base = layer.get_base_layer()
        if type(base) is not torch.nn.Linear:
            raise ValueError(
                f"lora.target_modules: {name} is a {type(base).__name__}; weir adapts "
                f"nn.Linear layers only ({', '.join(available)})"
            )
        if id(base.weight) in shared:  # merging would change the other user of the tensor too
            raise ValueError(
                f"lora.target_modules: {name} shares its weight with another layer (tied "
                "embeddings); leave it out of the targets"
            )
    if base_path is not None:
        peft_model.peft_config[ADAPTER].base_model_name_or_path = config.base_model_name_or_path
    return peft_model


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def lora_layers(model: PeftModel) -> Iterator[tuple[str, Any]]:
    """(name in the base model, layer) of every LoRA layer of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def delta_weight(layer: Any) -> torch.Tensor:
    """s * B @ A of one LoRA linear layer, in the base weight's dtype."""
    a = layer.lora_A[ADAPTER].weight
    b = layer.lora_B[ADAPTER].weight
    base = layer.get_base_layer().weight
    return (b.float() @ a.float() * layer.scaling[ADAPTER]).to(base.dtype)


@torch.no_grad()
def merged_weights(model: PeftModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's named parameters with every adapted weight merged: W + s B A.

    Names are those of the plain model (``model.layers.0.self_attn.q_proj.weight``), in its
    ``named_parameters()`` order; unadapted parameters are the trainer's own tensors (not copies).
    """
    layers = dict(lora_layers(model))
    lora_params = {
        id(p)
        for layer in layers.values()
        for p in (*layer.lora_A.parameters(), *layer.lora_B.parameters())
    }
    for name, param in model.get_base_model().named_parameters():
        if id(param) in lora_params:
            continue
        if ".base_layer." not in name:
            yield name, param
            continue
        prefix, leaf = name.split(".base_layer.", 1)
        if leaf == "weight":
            yield f"{prefix}.weight", param + delta_weight(layers[prefix])
        else:
            yield f"{prefix}.{leaf}", param


@torch.no_grad()
def merged_model(model: PeftModel) -> torch.nn.Module:
    """A plain copy of the base architecture holding the merged weights (for the engine, export)."""
    plain = copy.deepcopy(model).unload()
    own = dict(plain.named_parameters())
    for name, tensor in merged_weights(model):
        own[name].copy_(tensor)
    return plain


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (``...lora_A.weight``, ``...lora_B.weight``)."""
    return require_peft().get_peft_model_state_dict(model)


def load_adapter(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """Load the adapter saved in `adapter_dir` into the LoRA model `model`, in place.

    The adapter must have been made with the same rank and target modules (every adapter tensor of
    the model found, with its shape); anything else is refused with what differs.
    """
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not is_lora(model):
        raise ValueError(
            f"checkpoint {adapter_dir} holds a LoRA adapter: resume with lora.enabled=true "
            "and the same lora settings"
        )
    if not is_adapter_dir(adapter_dir):
        raise ValueError(
            f"checkpoint {adapter_dir} holds a whole model, not a LoRA adapter: resume it with "
            "lora.enabled=false, or start this LoRA run in a new run.dir"
        )
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    ours = model.peft_config[ADAPTER]
    for key, mine in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
        if saved.get(key) != mine:
            raise ValueError(
                f"checkpoint {adapter_dir} has a LoRA adapter with {key}={saved.get(key)}, this run "
                f"has {mine}: resume with the lora settings it was trained with"
            )
    state = load_file(adapter_dir / ADAPTER_WEIGHTS)
    own = adapter_state(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(
            f"checkpoint {adapter_dir} does not fit this LoRA model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, other shapes {shapes[:3]}; was lora.target_modules "
            "or model.path changed?"
        )
    result = require_peft().set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(
            f"checkpoint {adapter_dir}: adapter tensors not loaded: {result.unexpected_keys[:3]}"
        )


def save_final_model(model: torch.nn.Module, tokenizer: Any, run_dir: Path) -> Path:
    """A run's final model: ``<run>/model`` a plain HF directory (LoRA merged, so `weir eval` and
    `from_pretrained` load it as any model) and, for LoRA, the adapter alone in ``<run>/adapter``."""
    from weir.train.model import save_model

    if not is_lora(model):
        return save_model(model, tokenizer, run_dir / "model")
    save_model(model, tokenizer, run_dir / "adapter")
    plain = merged_model(model)
    plain.config.use_cache = True
    return save_model(plain, tokenizer, run_dir / "model")


class AdaptersOff:
    """The base model seen through a PeftModel: calls run with the adapters disabled.

    Used as the KL reference of a LoRA run (the frozen base weights are the initial policy), so the
    reference costs no memory. Attributes are the PeftModel's.
    """

    def __init__(self, model: PeftModel) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._model.disable_adapter():
            return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@contextlib.contextmanager
def adapter_dropout(model: PeftModel) -> Iterator[None]:
    """Adapter dropout modules in train mode for the enclosed forward/backward, then as before."""
    drops = [
        m
        for _, layer in lora_layers(model)
        for m in layer.lora_dropout.values()
        if isinstance(m, torch.nn.Dropout)
    ]
    modes = [m.training for m in drops]
    for m in drops:
        m.train()
    try:
        yield
    finally:
        for m, mode in zip(drops, modes, strict=True):
            m.train(mode)


class LoraActor(Actor):
    """The actor of a LoRA run: trains the adapters of a PeftModel, pushes merged weights.

    Differences from `Actor`: the reference for KL is the base model (`AdaptersOff`, no copy);
    adapter dropout (``lora.dropout``) is active in the gradient forward only; `weights()` yields
    the merged weights under the plain model's names.
    """

    def __init__(self, model: PeftModel, settings: ActorSettings) -> None:
        if not is_lora(model):
            raise TypeError("LoraActor trains a peft model; wrap it with apply_lora first")
        drops = {
            id(m): m.p
            for _, layer in lora_layers(model)
            for m in layer.lora_dropout.values()
            if isinstance(m, torch.nn.Dropout)
        }
        super().__init__(model, settings)
        # gradient checkpointing sets every dropout to 0 (the base model's must be); not the adapters'
        for _, layer in lora_layers(model):
            for m in layer.lora_dropout.values():
                if id(m) in drops:
                    m.p = drops[id(m)]

    def _reference(self, model: torch.nn.Module) -> Any:
        return AdaptersOff(model)

    def _accumulate(self, *args: Any, **kwargs: Any) -> None:
        with adapter_dropout(self.model):
            super()._accumulate(*args, **kwargs)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged weights W + s B A under the base model's parameter names."""
        return merged_weights(self.model)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)
