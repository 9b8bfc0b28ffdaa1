"""The torch engine's decode-step forward without the Hugging Face module machinery.

A decode step feeds one token per row through the model. For the small models weir trains on a CPU,
a quarter of that forward is not arithmetic but Python (docs/engine-speed.md): about 70 ``nn.Module`` calls (each through
``_call_impl`` with its hook checks), the output-capturing and kwargs-merging decorators of the HF
forward, config attribute look-ups, the attention-interface registry, output dataclasses. For the
Llama family (Llama, Mistral, Qwen2, Qwen3: pre-norm decoder layers, RMSNorm, rotary positions,
gated MLP) `DecodeForward` runs the same tensor operations, in the same order and on the same
parameters, straight from the modules' weights: the result is the same bits, only the dispatch
around them is gone. The attention itself is the model's own attention function (``sdpa`` or
``eager``), called as the model's attention layers call it, and the rotary embedding is the model's
own module, so rope scaling variants need no code here.

Two guards keep the engine exact. `DecodeForward.build` only accepts a model whose every module is
of the class this code mirrors, with no hooks on any module (a LoRA wrapper, a quantised linear, an
offloading hook: anything else is left to the HF forward). And the engine compares the two forwards
on its first decode step (`weir.engine.torch_engine`, `forwards_agree`): on the CPU unless the
logits are bit-for-bit equal, on CUDA unless they agree within rounding, the direct path is
dropped for good and the HF forward used instead (``stats()["decode_direct"]`` says which one
runs).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from weir.config.devices import rounding_tolerance
from weir.data.moe_routing import RoutingSpec, recording
from weir.engine.masks import layer_masks
from weir.hf_compat import cache_kwargs

__all__ = ["DecodeForward", "Decoding", "forwards_agree", "logprob_gap"]

log = logging.getLogger(__name__)

# model_type -> (class-name prefix of its modules, whether attention has q/k RMSNorms)
_FAMILY: dict[str, tuple[str, bool]] = {
    "llama": ("Llama", False),
    "mistral": ("Mistral", False),
    "qwen2": ("Qwen2", False),
    "qwen3": ("Qwen3", True),
}


def _plain(module: nn.Module) -> bool:
    """No forward hooks or pre-hooks, and no ``forward`` replaced on the instance (a patch or a
    wrapper), that the direct path would skip."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


class _Norm:
    """The Llama-family RMSNorm: ``w * (x * rsqrt(mean(x^2) + eps))``, computed in float32.

    As one ``F.rms_norm`` call where that gives the module's own bits on the weight's device and
    dtype (checked once, on random rows), else as the module writes it, op by op. On a CPU torch's
    ``rms_norm`` runs the same operations without the Python between them: there are 17 norms in a
    decode step of a 4-layer Qwen3, and each took half the time as one call (docs/engine-speed.md).
    """

    __slots__ = ("module", "eps", "fused", "shape")

    def __init__(self, module: nn.Module):
        self.module, self.eps = module, module.variance_epsilon
        self.shape = (int(module.weight.shape[-1]),)
        self.fused = self._fused_is_exact()

    @torch.no_grad()
    def _fused_is_exact(self) -> bool:
        w = self.module.weight
        g = torch.Generator().manual_seed(0)
        x = torch.randn((64, *self.shape), generator=g) * 3
        try:
            x = x.to(device=w.device, dtype=w.dtype)
            return torch.equal(F.rms_norm(x, self.shape, w, self.eps), self._written(x))
        except (RuntimeError, NotImplementedError):  # e.g. parameters on the meta device
            return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, self.shape, self.module.weight, self.eps)
        return self._written(x)

    def _written(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as the module writes it, op by op."""
        dtype = x.dtype
        if dtype != torch.float32:  # (``.to`` its own dtype is the tensor itself: skip the call)
            x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.module.weight * (x if dtype == torch.float32 else x.to(dtype))


class _Layer:
    __slots__ = (
        "attn",
        "idx",
        "ln1",
        "ln2",
        "q",
        "k",
        "v",
        "o",
        "q_norm",
        "k_norm",
        "gate",
        "up",
        "down",
        "act",
        "head_dim",
        "scaling",
        "extra",
        "mask_key",
    )


class DecodeForward:
    """Last-position logits of a one-token-per-row forward of a Llama-family model (see the module
    docstring). Built by `build`, which returns None for any model it does not mirror exactly."""

    def __init__(self, model: PreTrainedModel, qk_norm: bool, mask_keys: list[str]):
        base = model.model
        cfg = model.config
        self._embed = base.embed_tokens
        self.rotary = base.rotary_emb  # public: weir.engine.graphs reads its rope type
        self._norm = _Norm(base.norm)
        self._lm_head = model.lm_head
        # The attention function the model's own attention layers look up (its family's eager
        # implementation unless the registry has the configured one).
        own_eager = sys.modules[type(base.layers[0].self_attn).__module__].eager_attention_forward
        self._attention: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS.get_interface(
            cfg._attn_implementation, own_eager
        )
        self._layers: list[_Layer] = []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            a, mlp = layer.self_attn, layer.mlp
            lay = _Layer()
            lay.attn, lay.idx = a, a.layer_idx
            lay.ln1, lay.ln2 = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
            lay.q, lay.k, lay.v, lay.o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
            lay.q_norm = _Norm(a.q_norm) if qk_norm else None
            lay.k_norm = _Norm(a.k_norm) if qk_norm else None
            lay.gate, lay.up, lay.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
            lay.act = mlp.act_fn.forward  # no hooks (checked): skip the module call machinery
            lay.head_dim, lay.scaling = a.head_dim, a.scaling
            # The keyword arguments each family's attention layer passes to the attention function.
            window = getattr(a, "sliding_window", None)
            lay.extra = {"sliding_window": window} if hasattr(a, "sliding_window") else {}
            lay.mask_key = mask_keys[i]
            self._layers.append(lay)

    @classmethod
    def build(
        cls, model: nn.Module, per_layer_type: bool, vision: bool = False
    ) -> DecodeForward | None:
        """The direct forward for `model`, or None when it is not a plain Llama-family causal LM
        (other architectures, vision-language models, wrapped or hooked modules)."""
        cfg = getattr(model, "config", None)
        family = _FAMILY.get(getattr(cfg, "model_type", None))
        if family is None or vision or type(model).__name__ != f"{family[0]}ForCausalLM":
            return None
        prefix, qk_norm = family
        if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
            return None
        base = getattr(model, "model", None)
        if type(base).__name__ != f"{prefix}Model" or getattr(cfg, "attention_dropout", 0.0):
            return None
        if type(getattr(model, "lm_head", None)) is not nn.Linear:
            return None
        if getattr(cfg, "final_logit_softcapping", None) or getattr(
            cfg, "attn_logit_softcapping", None
        ):
            return None
        expected = {
            "layer": f"{prefix}DecoderLayer",
            "attn": f"{prefix}Attention",
            "mlp": f"{prefix}MLP",
            "norm": f"{prefix}RMSNorm",
            "rotary": f"{prefix}RotaryEmbedding",
        }
        if type(base.embed_tokens) is not nn.Embedding or base.embed_tokens.max_norm is not None:
            return None
        if type(base.norm).__name__ != expected["norm"]:
            return None
        if type(base.rotary_emb).__name__ != expected["rotary"]:
            return None
        layer_types = getattr(cfg, "layer_types", None)
        mask_keys: list[str] = []
        for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
            a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (
                type(layer).__name__ != expected["layer"]
                or type(a).__name__ != expected["attn"]
                or type(mlp).__name__ != expected["mlp"]
            ):
                return None
            linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
            linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            if any(type(m) is not nn.Linear for m in linears):
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if qk_norm:
                norms += [a.q_norm, a.k_norm]
            if any(type(m).__name__ != expected["norm"] for m in norms):
                return None
            if per_layer_type:
                if not layer_types:
                    return None
                mask_keys.append(layer_types[i])
            else:
                mask_keys.append("")
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return None
        if not all(_plain(m) for m in model.modules()):
            return None
        return cls(model, qk_norm, mask_keys)

    def __call__(
        self,
        ids: torch.Tensor,
        masks: torch.Tensor | dict[str, torch.Tensor],
        pos: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Logits of the last position, float32 [rows, vocab], for `ids` [rows, q] at positions
        `pos`, attending to the KV slabs of `cache` (whose columns it extends, as the HF forward
        does through the cache's ``update``) under `masks` (one per mask key, as `layer_masks`
        builds them). The cache geometry's ``length`` is left to the caller."""
        layers = cache.layers
        return self.run(ids, masks, pos, lambda idx, k, v: layers[idx].update(k, v))

    def run(
        self,
        ids: torch.Tensor,
        masks: torch.Tensor | dict[str, torch.Tensor],
        pos: torch.Tensor,
        kv: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """`__call__` with the KV write given as ``kv(layer_idx, keys, values)``, which stores the
        new columns and returns the keys and values to attend to (`weir.engine.graphs` writes at a
        column held in a tensor and attends to whole slabs, so that the step has fixed shapes)."""
        attention = self._attention
        by_key = masks if isinstance(masks, dict) else {"": masks}
        x = F.embedding(ids, self._embed.weight, self._embed.padding_idx)
        cos, sin = self.rotary(x, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        input_shape = x.shape[:-1]
        for lay in self._layers:
            residual = x
            h = lay.ln1(x)
            shape = (*input_shape, -1, lay.head_dim)
            q = F.linear(h, lay.q.weight, lay.q.bias).view(shape)
            k = F.linear(h, lay.k.weight, lay.k.bias).view(shape)
            if lay.q_norm is not None:
                q, k = lay.q_norm(q), lay.k_norm(k)
            v = F.linear(h, lay.v.weight, lay.v.bias).view(shape).transpose(1, 2)
            # The rotation is elementwise: queries and keys go through it together, as one tensor
            # of heads (the same values as rotating each).
            qk = torch.cat((q, k), dim=-2).transpose(1, 2)
            qk = (qk * cos) + (_rotate_half(qk) * sin)
            heads = q.shape[-2]
            q, k = qk[:, :heads], qk[:, heads:]
            keys, values = kv(lay.idx, k, v)
            out, _ = attention(
                lay.attn,
                q,
                keys,
                values,
                by_key[lay.mask_key],
                dropout=0.0,
                scaling=lay.scaling,
                **lay.extra,
            )
            out = out.reshape(*input_shape, -1).contiguous()
            x = residual + F.linear(out, lay.o.weight, lay.o.bias)
            residual = x
            h = lay.ln2(x)
            gated = lay.act(F.linear(h, lay.gate.weight, lay.gate.bias))
            h = F.linear(
                gated * F.linear(h, lay.up.weight, lay.up.bias), lay.down.weight, lay.down.bias
            )
            x = residual + h
        x = self._norm(x)
        logits = F.linear(x[:, -1:, :], self._lm_head.weight, self._lm_head.bias)
        return logits[:, -1, :].float()


def logprob_gap(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """A sampled token's log-prob error, nats: the mean over rows of
    E_{v ~ p_ref} |log p(v) - log p_ref(v)| for logits [rows, vocab]. A mean over the sampling
    distribution rather than a maximum, since a single bfloat16 logit may round a whole step
    apart."""
    lp, lp_ref = logits.float().log_softmax(-1), ref.float().log_softmax(-1)
    return (lp_ref.exp() * (lp - lp_ref).abs()).sum(-1).mean().item()


def forwards_agree(
    fast: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether the direct decode forward's logits `fast` may stand in for the HF forward's `ref`.

    On the CPU the two run the same kernels on the same tensors and must agree bit for bit. On
    CUDA the same operation can take another kernel, with another summation order, for a tensor
    of other strides (the direct forward's queries are a slice) or at another alignment, so they
    agree within rounding: `logprob_gap` at most `rounding_tolerance`. (A Ray engine worker on an
    H200 saw its bfloat16 forwards 0.0177 apart in the largest logit and fell back to the slower
    HF forward; which kernel differed was not pinned down.) A structural error (a mask or a
    rotation wrong) moves log-probs by tenths of a nat and is refused either way.
    """
    if torch.equal(fast, ref):
        return True
    if device.type != "cuda":
        return False
    return logprob_gap(fast, ref) <= rounding_tolerance(dtype, device)


@contextlib.contextmanager
def routing_record(spec: RoutingSpec | None):
    """`weir.data.moe_routing.recording` when the engine records routing, else nothing (None)."""
    if spec is None:
        yield None
        return
    with recording(spec) as rec:
        yield rec


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Decoding:
    """The decode step of `weir.engine.torch_engine.TorchEngine` (a mixin: the methods use the
    engine's state): one forward over the last token of every running row, then sampling and
    retirement (`weir.engine.admission`)."""

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        cache: Any,
        **pixels: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the last position, float32 [rows, vocab], through the model's own forward.
        `mask` is a boolean [rows, 1, q, kv] (causal + padding); sliding windows are added per layer
        type by `layer_masks`. `pixels`: a vision-language prefill's pixel inputs."""
        masks = layer_masks(mask, self._support, self._dtype if self._eager else None)
        with routing_record(self._routing) as rec:
            out = self.model(
                input_ids=ids,
                attention_mask=masks,  # prepared 4D masks (or a dict by layer type) used as given
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(self.model, cache),
                **pixels,
            )
        # routing recorded: the experts picked for each of `ids` [rows, q, layers, k]
        self._last_routes = None if rec is None else rec.stacked(*ids.shape)
        cache.geo.length += ids.shape[1]
        return out.logits[:, -1, :].float()

    def _decode_forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """`_forward` for a decode step, through `DecodeForward` once it has been seen to give the
        HF forward's logits (`forwards_agree`: bit for bit on a CPU, within rounding on CUDA;
        checked on the first decode step, and if they differ the HF forward is used from then
        on)."""
        direct = self._direct
        if direct is None:
            return self._forward(ids, mask, pos, cache)
        if self._direct_checked:
            masks = layer_masks(mask, self._support, self._dtype if self._eager else None)
            logits = direct(ids, masks, pos, cache)
            cache.geo.length += ids.shape[1]
            return logits
        masks = layer_masks(mask, self._support, self._dtype if self._eager else None)
        fast = direct(ids, masks, pos, cache)  # writes the new KV column; HF's forward rewrites it
        logits = self._forward(ids, mask, pos, cache)
        if forwards_agree(fast, logits, self._dtype, self._device):
            self._direct_checked = True
        else:
            self._direct = None
            log.warning(
                "weir engine: the direct decode forward differs from the model's own forward "
                "(max |logit difference| %.3g, log-prob gap %.3g) on %s; decoding through the HF "
                "forward instead",
                (fast - logits).abs().max().item(),
                logprob_gap(fast, logits),
                type(self.model).__name__,
            )
        return logits

    def _fixed_shape_forward(self, b: Any) -> torch.Tensor:
        """`_decode_forward` through `weir.engine.graphs.StaticDecode` (CUDA graphs). Its first
        step is checked against the eager direct forward: a sampled token's log-prob within rounding
        on average (`weir.config.devices.rounding_tolerance`), else a warning and the eager forward
        from then on."""
        logits = self._static(b)
        if not self._static_checked:
            mask = self._col[: b.geo.length + 1].unsqueeze(0) >= b.start.unsqueeze(1)
            masks = layer_masks(
                mask[:, None, None, :], self._support, self._dtype if self._eager else None
            )
            # rewrites the KV column just written, with the eager step's values
            ref = self._direct(b.tok.unsqueeze(1), masks, b.pos.unsqueeze(1), b.cache)
            err = logprob_gap(logits, ref)
            if err <= rounding_tolerance(self._dtype, self._device):
                self._static_checked = True
            else:
                self._static = None
                log.warning(
                    "weir engine: the fixed-shape (CUDA graph) decode step differs from the eager "
                    "one by %.3g in log-prob on %s; decoding eagerly instead",
                    err,
                    type(self.model).__name__,
                )
            logits = ref
        b.cache.geo.length += 1
        return logits

    def _decode_step(self) -> None:
        b = self._batch
        geo = b.geo
        cols = b.cache.layers[0].keys.shape[2]
        if geo.c0 + geo.length >= cols:
            # Out of columns on the right (rows outlived the headroom): move left within the slabs
            # when they are wide enough, else to larger slabs.
            if geo.length + b.remaining() < cols:
                b._move_live(geo.length, b.remaining())
            else:
                b._realloc_cache(b.n, geo.length, max(b.remaining(), 16), b.cache)
        if self._static is not None and self._direct_checked:
            logits = self._fixed_shape_forward(b)
        else:
            mask = self._col[: b.geo.length + 1].unsqueeze(0) >= b.start.unsqueeze(1)
            logits = self._decode_forward(
                b.tok.unsqueeze(1), mask[:, None, None, :], b.pos.unsqueeze(1), b.cache
            )
        b.pos += 1
        if self._routing is not None:  # the experts picked for each row's fed token
            for r, picked in enumerate(self._last_routes):
                b.routes[r].append(picked)
        self._sample_and_record(b, logits)
        self._stats["decode_steps"] += 1
        done = self._retire_done(b)
        if done is not None:
            b.remove(done)
