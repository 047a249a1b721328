"""Shard readiness: its Unix socket exists and answers a gRPC `ShardService.Health` call."""

from __future__ import annotations

import os

from tgis.shard_api.health_probe import shard_answers_health

HEALTH_TIMEOUT_S = 2.0


def shard_is_ready(socket_path: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """True once `socket_path` exists and the shard behind it answers Health."""
    return os.path.exists(socket_path) and shard_answers_health(socket_path, timeout)
