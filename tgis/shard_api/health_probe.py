"""Is a shard answering? One synchronous gRPC `ShardService.Health` call over its Unix socket.

For callers outside an event loop (the launcher waiting for its shards to start); any RPC
error, the socket missing or nobody listening included, reads as "not answering".
"""

from __future__ import annotations

import grpc

from tgis.pb import shard_pb2, shard_pb2_grpc


def shard_answers_health(socket_path: str, timeout: float) -> bool:
    """True if the shard serving ``unix://<socket_path>`` answers Health within ``timeout``
    seconds."""
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        try:
            stub.Health(shard_pb2.HealthRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return True
