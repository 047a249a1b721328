"""Shard readiness: its Unix socket exists and answers a gRPC `ShardService.Health` call."""

from __future__ import annotations

import os

HEALTH_TIMEOUT_S = 2.0


def shard_is_ready(socket_path: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """True once `socket_path` exists and the shard behind it answers Health."""
    if not os.path.exists(socket_path):
        return False
    import grpc  # imported lazily: validation errors stay fast

    from tgis.pb import shard_pb2, shard_pb2_grpc

    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        try:
            stub.Health(shard_pb2.HealthRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return True
