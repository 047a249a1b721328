"""Check which ranks of the tensor-parallel group this launcher runs (``--nnodes``,
``--node-rank``; ``config.NodePlacement``).

``--num-shard`` is the whole group's size; with ``--nnodes N`` each node's launcher starts
``num_shard / N`` of the ranks, node ``R`` ranks ``R * per_node`` up to ``(R + 1) * per_node``.
Node 0 (the leader) runs rank 0, whose socket the router talks to, and the router; the other
nodes (workers) run shards only. LeaderWorkerSet sets LWS_GROUP_SIZE and LWS_WORKER_INDEX
(the leader is index 0), which ``--nnodes`` and ``--node-rank`` read when NNODES and
NODE_RANK are unset.
"""

from __future__ import annotations

from tgis.launcher.config import ConfigError, NodePlacement


def resolve_placement(num_shard: int, nnodes: int, node_rank: int) -> NodePlacement:
    """Check ``--nnodes`` and ``--node-rank`` against ``--num-shard``; ConfigError if wrong."""
    if nnodes < 1:
        raise ConfigError("--nnodes / NNODES must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"--node-rank / NODE_RANK must be from 0 to nnodes - 1 ({nnodes - 1}), got {node_rank}"
        )
    if num_shard % nnodes:
        raise ConfigError(
            f"--num-shard ({num_shard}) must be a multiple of --nnodes ({nnodes}): every node "
            "runs the same number of ranks"
        )
    return NodePlacement(world_size=num_shard, nnodes=nnodes, node_rank=node_rank)
