"""Weight transports from the trainer to the engines: in-process, torch.distributed broadcast, disk.

Every transport delivers the full (unsharded) named tensors with a version; after a sync every
engine's weights hash to the trainer's (`weights_hash`). On Ray the default streams them from the
FSDP2 shards bucket by bucket (`weir.sync.shards`), by broadcast group or memory handle
(`weir.sync.handles`), so no process holds the whole model.
"""

from weir.sync.broadcast import BroadcastGroup, Tensor, TensorMeta, plan_buckets
from weir.sync.disk import DiskStore
from weir.sync.hashing import weights_hash
from weir.sync.inprocess import push_in_process

__all__ = [
    "BroadcastGroup",
    "DiskStore",
    "Tensor",
    "TensorMeta",
    "plan_buckets",
    "push_in_process",
    "weights_hash",
]
