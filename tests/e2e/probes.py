"""What the e2e tests watch on a launched server: the gRPC health status, a sample of its
/metrics, and waiting for a condition; and the greedy parameters they ask for. (Calls
consumed by a thread: streams.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tgis.launcher.local_process import LauncherProcess
from tgis.pb import generation_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def greedy(tokens: int) -> pb.Parameters:
    """Greedy decoding of exactly ``tokens`` tokens."""
    return pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens),
    )


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def health_status(channel: grpc.Channel, timeout: float = 5.0) -> int:
    """grpc.health.v1 Check of the whole server."""
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status)


def metric_sample(server: LauncherProcess, sample: str) -> float | None:
    """The value of one unlabelled sample (or ``name{labels}`` as exposed) of the server's
    /metrics; None when it is not exposed."""
    _, body = server.http_get("/metrics")
    for line in body.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return None
