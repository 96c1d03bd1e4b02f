"""Training models that do not fit one device: the trainer group shards the policy (FSDP2).

See :mod:`digen.parallel.fsdp`. Importing this package loads torch but no distributed
backend; nothing here starts a process group.
"""

from __future__ import annotations

from digen.parallel.fsdp import ShardedTrainer, gather_trainable_state, shard_rows, shard_transformer

__all__ = ["ShardedTrainer", "gather_trainable_state", "shard_rows", "shard_transformer"]
