"""Sharding one model over several machines with ``mx.distributed`` (ring over TCP, or JACCL over RDMA).

- ``pipeline`` / ``tensor``: transform a loaded model in place into one rank's shard.
- ``runtime``: join the group, load a shard, drive it from rank 0's Engine or follow on the other ranks.
- ``launch`` / ``hosts``: ``mlx-infer launch`` and ``mlx-infer hosts check``.
"""

from .pipeline import PipelineShard, shard_pipeline
from .tensor import TensorShard, shard_tensor

__all__ = ["PipelineShard", "TensorShard", "shard_pipeline", "shard_tensor"]
