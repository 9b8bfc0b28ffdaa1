"""A planning model of one GRPO step at real sizes: time and memory per GPU, weight sync, checkpoint.

Nothing here is measured on GPUs: every figure follows from the hardware figures and workload
assumptions below (each one named, with its source or marked as an assumption), so that a reader
can change one and see what moves. docs/distributed.md prints the default table and explains it.

    python benchmarks/plan_scale.py                        # 7B and 32B on 8, 16, 32, 64 H100s
    python benchmarks/plan_scale.py --response 4096 --mfu 0.3
    python benchmarks/plan_scale.py --json plan.json

The step (synchronous GRPO, colocated: every GPU trains, then every GPU generates):

- generate: decode is memory-bound; one decode step of an engine replica (tensor parallel over
  `tp` GPUs) reads its weight shard and the KV cache of its running sequences from HBM:
      t_step = (2 P / tp + kv_bytes_live / tp) / (HBM_BW * hbm_eff)
  floored by compute (2 P flops per token); `response_max` steps when the whole batch fits (it
  waits for its longest response; the live rows shrink to mean / max on average), else enough
  full-occupancy steps for all its tokens.
  Prefill at the training FLOP rate.
- train: (6 P + 6 L d s) flops per token for forward and backward (causal attention over mean
  context s), plus a 2 P forward for the old-policy log-probs and one for the reference (KL), at
  `mfu` of the bf16 peak on every GPU.
- weight sync (weir's design, weir.sync.shards): each bucket is all-gathered by the trainer ranks in
  bf16 (every rank receives (G-1)/G of it) and sent by rank 0 alone to the engines (one NCCL
  broadcast, or CUDA IPC for the engine on its own GPU), bucket after bucket, not overlapped:
      t_sync = 2P (G-1)/G / BW_gather + 2P / BW_send + buckets * latency
  BW_gather: NVLink inside a node, the InfiniBand NIC per GPU across nodes; BW_send: rank 0's NVLink
  when every engine is in its node, else its one NIC.
- offload (colocated): the trainer's shards, gradients and optimizer state (16 P / G bytes per GPU)
  to host and back over PCIe per step; the engine's weights (2 P / tp) likewise when they sleep.
- checkpoint (sharded, each rank writes its own part): 16 P bytes (fp32 weights + AdamW moments) at
  the nodes' aggregate write bandwidth.
- memory per GPU: trainer 16 P / G (fp32 master, fp32 grad, two fp32 AdamW moments) + two bf16
  decoder layers gathered (FSDP2 prefetch) + activations with checkpointing (one layer input per
  layer per token of a micro-batch, bf16, plus one layer's working set) + logits of one chunk;
  engine 2 P / tp + the KV cache of the rows it decodes at once (weights at most half a GPU, KV up
  to 90% of it; when the batch's KV does not fit, it decodes in more steps at full occupancy).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

GB = 1e9

# -- hardware (one HGX/DGX H100 node = 8 GPUs) ---------------------------------------------------
HW = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense bf16 tensor core (1,979 with sparsity), 80 GB
    # HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s per GPU (both directions together, 450 each way).
    "peak_bf16_flops": 989e12,
    "hbm_bytes_per_s": 3.35e12,
    "hbm_bytes": 80e9,
    "nvlink_bytes_per_s": 450e9,  # one direction
    # DGX H100: eight ConnectX-7 NDR InfiniBand ports, 400 Gb/s = 50 GB/s each, one per GPU.
    "ib_bytes_per_s": 50e9,
    # PCIe Gen5 x16: 64 GB/s per direction (PCI-SIG); the H100 SXM host link.
    "pcie_bytes_per_s": 64e9,
    "gpus_per_node": 8,
}

# -- efficiencies and storage: assumptions, not measurements ------------------------------------
ASSUMED = {
    "mfu": 0.40,  # training model-FLOP utilisation with FSDP2 and bf16 at these sizes
    "hbm_eff": 0.75,  # fraction of HBM bandwidth a decode step reaches
    "nccl_nvlink_eff": 0.70,  # all-gather / broadcast bus bandwidth vs NVLink one-way peak
    "nccl_ib_eff": 0.80,  # vs the NIC line rate
    "pcie_eff": 0.40,  # vs PCIe peak, pageable memory's; the pinned offload is not yet measured
    "bucket_latency_s": 200e-6,  # per bucket: launch, sync, a Ray round trip for IPC
    "node_write_bytes_per_s": 5e9,  # checkpoint write per node (local NVMe RAID or a parallel FS)
}

# Qwen2.5 configs (config.json on the Hugging Face hub): parameters, layers, hidden, KV heads x dim
MODELS = {
    "7B": {"params": 7.62e9, "layers": 28, "hidden": 3584, "kv_heads": 4, "head_dim": 128},
    "32B": {"params": 32.8e9, "layers": 64, "hidden": 5120, "kv_heads": 8, "head_dim": 128},
}


@dataclass
class Workload:
    prompts: int = 128  # per step
    n: int = 8  # samples per prompt
    prompt_len: int = 512
    response_mean: int = 1024
    response_max: int = 4096
    micro_batch_tokens: int = 16384  # per GPU
    kl: bool = True  # a reference forward per step
    bucket_mb: float = 64.0


@dataclass
class Plan:
    model: str
    gpus: int
    tp: int
    generate_s: float
    train_s: float
    sync_s: float
    offload_s: float
    step_s: float
    checkpoint_s: float
    trainer_gb: float
    engine_gb: float
    fits_colocated: bool


def plan(name: str, gpus: int, w: Workload, hw=HW, a=ASSUMED) -> Plan:
    m = MODELS[name]
    p, layers, d = m["params"], m["layers"], m["hidden"]
    kv_per_token = 2 * layers * m["kv_heads"] * m["head_dim"] * 2  # K and V, bf16
    nodes = math.ceil(gpus / hw["gpus_per_node"])
    seqs = w.prompts * w.n
    context = w.prompt_len + w.response_mean
    tokens = seqs * context

    # engines: the smallest tensor-parallel degree whose weights take at most half of each GPU;
    # the rest (to 90%) is KV cache, and the replica decodes as many rows at once as fit there
    tp = 1
    while 2 * p / tp > 0.5 * hw["hbm_bytes"] and tp < hw["gpus_per_node"]:
        tp *= 2
    replicas = gpus // tp
    per_replica = seqs / replicas
    kv_row = (w.prompt_len + w.response_mean) * kv_per_token  # a row's KV, on average
    capacity = (0.9 * hw["hbm_bytes"] - 2 * p / tp) * tp
    rows = min(per_replica, capacity / kv_row)  # rows decoding at once
    steps = max(w.response_max, per_replica * w.response_mean / rows)
    live = rows * (w.response_mean / w.response_max if rows == per_replica else 1.0)
    kv_live = live * (w.prompt_len + w.response_mean / 2) * kv_per_token
    hbm = hw["hbm_bytes_per_s"] * a["hbm_eff"]
    t_mem = (2 * p + kv_live) / tp / hbm
    t_flop = 2 * p * live / (tp * hw["peak_bf16_flops"] * a["mfu"])
    prefill = 2 * p * seqs * w.prompt_len / (gpus * hw["peak_bf16_flops"] * a["mfu"])
    generate = steps * max(t_mem, t_flop) + prefill

    flops = tokens * (6 * p + 6 * layers * d * context) + tokens * 2 * p * (2 if w.kl else 1)
    train = flops / (gpus * hw["peak_bf16_flops"] * a["mfu"])

    wire = 2 * p
    if gpus <= hw["gpus_per_node"]:
        bw_gather = hw["nvlink_bytes_per_s"] * a["nccl_nvlink_eff"]
        bw_send = bw_gather
    else:
        bw_gather = hw["ib_bytes_per_s"] * a["nccl_ib_eff"]
        bw_send = bw_gather  # engines on other nodes: rank 0's one NIC
    buckets = wire / (w.bucket_mb * 2**20)
    sync = wire * (gpus - 1) / gpus / bw_gather + wire / bw_send + buckets * a["bucket_latency_s"]

    pcie = hw["pcie_bytes_per_s"] * a["pcie_eff"]
    trainer_state = 16 * p / gpus
    offload = 2 * trainer_state / pcie + 2 * (2 * p / tp) / pcie

    layer_params = (p - 152064 * d) / layers
    gathered = 2 * 2 * layer_params  # two bf16 layers (current + prefetched)
    activations = w.micro_batch_tokens * d * 2 * layers + w.micro_batch_tokens * d * 2 * 16
    logits = 256 * 152064 * 4 * 3  # one log-prob chunk of float32 temporaries
    trainer_gb = (trainer_state + gathered + activations + logits) / GB
    engine_gb = (2 * p / tp + rows * kv_row / tp) / GB

    checkpoint = 16 * p / (nodes * a["node_write_bytes_per_s"])
    step = generate + train + sync + offload
    fits = trainer_gb < 0.95 * hw["hbm_bytes"] / GB  # the engine's KV is sized to fit
    return Plan(
        name,
        gpus,
        tp,
        generate,
        train,
        sync,
        offload,
        step,
        checkpoint,
        trainer_gb,
        engine_gb,
        fits,
    )


def table(plans: list[Plan]) -> str:
    head = (
        "| model | GPUs | engine TP | generate s | train s | sync s | offload s | step s "
        "| checkpoint s | trainer GB/GPU | engine GB/GPU | trainer fits |"
    )
    rows = [head, "|" + " --- |" * 12]
    for r in plans:
        rows.append(
            f"| {r.model} | {r.gpus} | {r.tp} | {r.generate_s:.0f} | {r.train_s:.0f} "
            f"| {r.sync_s:.2f} | {r.offload_s:.1f} | {r.step_s:.0f} | {r.checkpoint_s:.0f} "
            f"| {r.trainer_gb:.0f} | {r.engine_gb:.0f} | {'yes' if r.fits_colocated else 'no'} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="7B,32B")
    ap.add_argument("--gpus", default="8,16,32,64")
    for field, value in asdict(Workload()).items():
        flag = f"--{field.replace('_', '-')}"
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    for key, value in ASSUMED.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=float, default=value)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    w = Workload(**{f: getattr(args, f) for f in asdict(Workload())})
    a = {k: getattr(args, k) for k in ASSUMED}
    plans = [
        plan(m, int(g), w, HW, a) for m in args.models.split(",") for g in args.gpus.split(",")
    ]
    print(table(plans))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(p) for p in plans], f, indent=1)


if __name__ == "__main__":
    main()
