"""LoRA on FSDP2 trainer ranks: peft adapters applied to the model before it is sharded.

Each rank loads the base model, wraps it with the run's adapters (`weir.train.lora.apply_lora`, the
same seed as one process, so A starts identical on every rank and in a one-process run), and shards
the PeftModel with FSDP2: the frozen base weights and the adapters A, B are sharded alike, and only
A and B have gradients and optimizer state. The KL reference is the same sharded model with its
adapters switched off (no copy), as in one process.

What the engines get is built from the shards at sync time (weir.sync.lora_wire): merged weights
W + s B A under the base model's names, or the adapter alone for an engine that applies it itself.
"""

from __future__ import annotations

from weir.train.lora import LoraActor
from weir.train.sharded_actor import ShardedActor


class ShardedLoraActor(LoraActor, ShardedActor):
    """`LoraActor` on an FSDP2-sharded PeftModel: the reference is the base model seen with the
    adapters off (`LoraActor._reference`), so no sharded copy of the initial model is made."""

    copies_reference = False
