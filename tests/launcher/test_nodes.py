"""``--nnodes`` / ``--node-rank``: each node's share of the ranks, and what is refused."""

from __future__ import annotations

import re

import pytest

from tgis.launcher.config import ConfigError, NodePlacement
from tgis.launcher.nodes import resolve_placement


def test_each_node_runs_its_consecutive_share_of_the_ranks() -> None:
    shares = [resolve_placement(8, 2, node) for node in (0, 1)]
    assert [list(p.ranks) for p in shares] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.is_leader for p in shares] == [True, False]
    assert [p.local_rank(r) for p in shares for r in p.ranks] == [0, 1, 2, 3] * 2
    assert resolve_placement(2, 1, 0) == NodePlacement(world_size=2)
    assert not NodePlacement(world_size=2).multinode and shares[1].multinode


@pytest.mark.parametrize(
    ("num_shard", "nnodes", "node_rank", "message"),
    [
        (3, 2, 0, "--num-shard (3) must be a multiple of --nnodes (2)"),
        (4, 2, 2, "--node-rank / NODE_RANK must be from 0 to nnodes - 1 (1), got 2"),
        (4, 2, -1, "got -1"),
        (4, 0, 0, "--nnodes / NNODES must be at least 1"),
    ],
)
def test_a_share_that_cannot_be_is_refused(
    num_shard: int, nnodes: int, node_rank: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_placement(num_shard, nnodes, node_rank)
