"""Tensor parallelism: the rank's place in the group and the sharded layers built on it."""

from tgis.shard.native.parallel.group import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
