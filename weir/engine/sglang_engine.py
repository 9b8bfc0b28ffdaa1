"""`engine.type: sglang`: SGLang servers behind weir's `ServerEngine`, through SGLang's native HTTP API.

NOT VERIFIED AGAINST A LIVE SERVER. SGLang's CPU backend needs its sgl-kernel built from source for
x86 CPUs with AMX; weir's reference machine has neither a GPU nor AMX, so this adapter is written to
SGLang's documented HTTP API and tested against a stand-in server that implements that documented
schema (tests/engine/test_sglang_adapter.py). See docs/engines.md.

The endpoints weir uses (as slime does):

- ``POST /generate`` with ``input_ids``, ``sampling_params`` (``temperature``, ``top_p``, ``top_k``
  (-1 off), ``max_new_tokens``, ``stop_token_ids``, ``sampling_seed``, ``no_stop_trim``,
  ``skip_special_tokens``), ``return_logprob: true`` and ``stream: true``. Each SSE event carries
  ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples, cumulative over the
  stream, and ``meta_info.finish_reason`` (``{"type": "stop" | "length" | "abort"}``) on the last.
- ``POST /update_weights_from_disk`` ``{"model_path": dir}`` -> ``{"success": bool, "message": str}``;
  ``POST /flush_cache`` afterwards.
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` (servers started with
  ``--enable-memory-saver``) for colocation.
- ``POST /init_weights_update_group`` and ``POST /update_weights_from_distributed`` (NCCL from the
  trainer; GPU only, not exercised by weir's tests).

Log-probs: SGLang reports the sampled token's log-prob; whether it is taken before or after the
temperature depends on the SGLang version (``SGLANG_RETURN_ORIGINAL_LOGPROB``). weir's convention is
``log_softmax(logits / T)``; with rollout.temperature = 1 both readings agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weir.engine.base import SamplingParams
from weir.engine.server_engine import ServerEngine, ServerError
from weir.engine.servers import (
    ServerProcess,
    check_installed,
    default_python,
    model_max_len,
)

INSTALL_HINT = (
    'pip install "sglang[all]" in a GPU environment of its own and set engine.python to its '
    "python (SGLang has no CPU wheel; see docs/engines.md)"
)


class SglangBackend:
    """How weir speaks to an SGLang server (native API)."""

    name = "sglang"
    # SGLang's /health generates a token through the scheduler (up to 20 s), which a weight
    # update keeps busy; its model info is the HTTP process's own
    liveness_path = "/get_model_info"

    def request(
        self, context: list[int], params: SamplingParams, max_tokens: int, seed: int
    ) -> tuple[str, dict[str, Any]]:
        body = {
            "input_ids": context,
            "sampling_params": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k if params.top_k > 0 else -1,
                "max_new_tokens": max_tokens,
                "stop_token_ids": params.stop_token_ids,
                "sampling_seed": seed,
                "no_stop_trim": True,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "stream": True,
        }
        return "/generate", body

    def parse_event(
        self, event: dict[str, Any], seen: int
    ) -> tuple[list[tuple[int, float]], str | None]:
        meta = event.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        pairs = [(int(t[1]), float(t[0])) for t in triples[seen:]]
        reason = meta.get("finish_reason")
        finish = None
        if reason is not None:
            kind = reason.get("type") if isinstance(reason, dict) else str(reason)
            finish = kind if kind in ("stop", "length", "abort") else "stop"
        return pairs, finish

    async def _post(self, client: Any, url: str, path: str, body: dict | None = None) -> Any:
        resp = await client.post(url + path, json=body if body is not None else {}, timeout=600.0)
        if resp.status_code >= 400:
            raise ServerError(f"SGLang {url}{path} answered {resp.status_code}: {resp.text[:500]}")
        try:
            out = resp.json()
        except ValueError:
            return None
        if isinstance(out, dict) and out.get("success") is False:
            raise ServerError(f"SGLang {url}{path} failed: {out.get('message')}")
        return out

    async def load_from_disk(self, client: Any, url: str, path: str, digest: bool = False) -> None:
        await self._post(client, url, "/update_weights_from_disk", {"model_path": str(path)})
        await self._post(client, url, "/flush_cache")

    async def sleep(self, client: Any, url: str) -> None:
        await self._post(client, url, "/release_memory_occupation")

    async def wake(self, client: Any, url: str) -> None:
        await self._post(client, url, "/resume_memory_occupation")

    # -- weights over a torch.distributed group (weir.sync.server_sync) ---------------------------
    # NOT verified against a live SGLang: written to its documented API (see the module docstring)

    group_style = (
        "sglang"  # /init_weights_update_group builds the group with init_custom_process_group
    )
    per_tensor = True  # /update_weights_from_distributed receives one broadcast per tensor
    flushes_on_receive = True  # the last bucket's call flushes the cache itself

    async def workers(self, client: Any, url: str) -> int:
        """The server's tensor-parallel size (``/get_server_info``): each TP rank joins the group."""
        resp = await client.get(url + "/get_server_info", timeout=60.0)
        if resp.status_code >= 400:
            return 1
        info = resp.json()
        return int(info.get("tp_size") or info.get("server_args", {}).get("tp_size") or 1)

    async def init_broadcast(
        self, client: Any, url: str, host: str, port: int, rank_offset: int, world_size: int,
        backend: str, name: str,
    ) -> None:  # fmt: skip
        """Join the trainer's weight-update group (``/init_weights_update_group``)."""
        await self._post(
            client,
            url,
            "/init_weights_update_group",
            {
                "master_address": host,
                "master_port": port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": name,
                "backend": backend,
            },
        )

    async def receive_broadcast(
        self, client: Any, url: str, buckets: list, name: str, digest: bool = False
    ) -> None:
        """One ``/update_weights_from_distributed`` per bucket, in the order rank 0 broadcasts
        them (each tensor a broadcast of its own); the server loads each bucket when it has it."""
        for k, bucket in enumerate(buckets):
            await self._post(
                client,
                url,
                "/update_weights_from_distributed",
                {
                    "names": [m.name for m in bucket],
                    "dtypes": [m.dtype for m in bucket],
                    "shapes": [list(m.shape) for m in bucket],
                    "group_name": name,
                    "flush_cache": k == len(buckets) - 1,
                },
            )

    async def reset_cache(self, client: Any, url: str) -> None:
        await self._post(client, url, "/flush_cache")


def sglang_argv(
    python: str, model_path: str, port: int, *, dtype: str, max_model_len: int, seed: int,
    memory_saver: bool, extra_args: list[str], kv_tokens: int | None = None,
    kv_budget_fraction: float | None = None, host: str = "127.0.0.1", tp_size: int = 1,
) -> list[str]:  # fmt: skip
    """The command that starts one SGLang server for weir, listening on `host` with `tp_size` GPUs.

    `kv_tokens` (from `engine.kv_budget_gb`, see `kv_pool_tokens`) becomes ``--max-total-tokens``
    and `engine.kv_budget_fraction` ``--mem-fraction-static`` (SGLang's meaning: the share of GPU
    memory for the weights and the KV pool)."""
    argv = [
        python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
        "--port", str(port), "--dtype", dtype, "--context-length", str(max_model_len),
        "--random-seed", str(seed), "--skip-server-warmup",
    ]  # fmt: skip
    if tp_size > 1:
        argv += ["--tp-size", str(tp_size)]
    if kv_tokens is not None:
        argv += ["--max-total-tokens", str(kv_tokens)]
    if kv_budget_fraction is not None:
        argv += ["--mem-fraction-static", str(kv_budget_fraction)]
    if memory_saver:
        argv.append("--enable-memory-saver")
    return argv + list(extra_args)


def kv_pool_tokens(model_path: str, dtype: str, kv_budget_gb: float | None) -> int | None:
    """Tokens of KV cache that fit in `kv_budget_gb` GiB for the model at `model_path` (keys and
    values of every layer: 2 x layers x kv_heads x head_dim x dtype bytes per token)."""
    if kv_budget_gb is None:
        return None
    import torch
    from transformers import AutoConfig

    from weir.engine.kv_budget import GB, cell_bytes

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype, torch.float32)
    return max(1, int(kv_budget_gb * GB) // cell_bytes(config, torch_dtype))


@dataclass(frozen=True)
class SglangLauncher:
    """How one SGLang server of a run is started: ``launcher(index, port, host)`` is its (not yet
    started) `ServerProcess`. Picklable, so a Ray actor on another node can start it there."""

    python: str
    model_path: str
    work_dir: Path
    dtype: str
    max_model_len: int
    seed: int
    memory_saver: bool
    extra_args: tuple[str, ...]
    kv_tokens: int | None
    kv_budget_fraction: float | None
    startup_timeout_s: float
    tp_size: int = 1

    def check(self) -> None:
        check_installed(self.python, "sglang", INSTALL_HINT)

    def __call__(self, index: int, port: int, host: str = "127.0.0.1") -> ServerProcess:
        return ServerProcess(
            argv=sglang_argv(
                self.python,
                self.model_path,
                port,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed + index,
                memory_saver=self.memory_saver,
                extra_args=list(self.extra_args),
                kv_tokens=self.kv_tokens,
                kv_budget_fraction=self.kv_budget_fraction,
                host=host,
                tp_size=self.tp_size,
            ),
            url=f"http://{host}:{port}",
            log_path=Path(self.work_dir) / f"sglang-{index}.log",
            startup_timeout_s=self.startup_timeout_s,
        )


def start_sglang(
    ecfg: Any,
    model_path: str,
    work_dir: str | Path,
    *,
    eos_token_ids: list[int],
    dtype: str,
    seed: int,
    place: Any = None,
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
) -> ServerEngine:
    """Start (or attach to) the SGLang servers of `ecfg` (an `EngineConfig`); `place` as in
    `weir.engine.remote.launch_servers`. SGLang takes merged weights only (`lora_rank` must be
    None: weir's adapter-only sync is vLLM's LoRA endpoint)."""
    from weir.engine.remote import launch_servers

    if lora_rank is not None:
        raise ValueError("lora.sync=adapter needs engine.type=vllm; SGLang takes merged weights")
    work = Path(work_dir)
    max_len = model_max_len(model_path, ecfg.max_model_len)
    launcher = SglangLauncher(
        python=ecfg.python or default_python(".venv-sglang"),
        model_path=model_path,
        work_dir=work,
        dtype=dtype,
        max_model_len=max_len,
        seed=seed,
        memory_saver=ecfg.sleep_mode,
        extra_args=tuple(ecfg.extra_args),
        kv_tokens=kv_pool_tokens(model_path, dtype, ecfg.kv_budget_gb),
        kv_budget_fraction=ecfg.kv_budget_fraction,
        startup_timeout_s=ecfg.startup_timeout_s,
        tp_size=tensor_parallel_size,
    )
    if not ecfg.urls and place is None:
        launcher.check()
    return launch_servers(
        SglangBackend(),
        ecfg,
        model_path,
        work,
        launcher,
        eos_token_ids=eos_token_ids,
        max_len=max_len,
        seed=seed,
        place=place,
    )
