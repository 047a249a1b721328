"""Clients that stop reading (issue 11, item 5): a stream whose client takes no message
for ``TGIS_STREAM_STALL_TIMEOUT`` seconds is cancelled; meanwhile the batch goes on, the
router's memory stays bounded, and afterwards every permit and KV block is back.

The stalled clients speak HTTP/2 over a raw socket: they send a GenerateStream request
with a small flow-control window and never read again, as a client whose process hangs
would (a gRPC library client keeps reading into its own buffers).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing

import grpc
import pytest

from tests.e2e.probes import greedy, metric_sample, wait_until
from tests.e2e.server import LauncherProcess, healthy_launcher
from tests.e2e.streams import start_stream
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.procinfo import resident_kib

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 8
MAX_CONCURRENT = 8
STALLED = 6

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS = 0, 1, 4
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 4


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream_id)
        + payload
    )


def header(name: str, value: str) -> bytes:
    """One HPACK "literal header field without indexing, new name" (short strings)."""
    raw_name, raw_value = name.encode(), value.encode()
    assert len(raw_name) < 127 and len(raw_value) < 127
    return b"\x00" + bytes([len(raw_name)]) + raw_name + bytes([len(raw_value)]) + raw_value


def stalled_stream(port: int, request: pb.SingleGenerationRequest) -> socket.socket:
    """A GenerateStream sent with a 16 KiB window by a client that then never reads."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        HTTP2_PREFACE
        + frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 16384))
    )
    time.sleep(0.1)  # the server's SETTINGS have arrived: acknowledge them unread
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/fmaas.GenerationService/GenerateStream"),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    body = request.SerializeToString()
    message = b"\x00" + struct.pack(">I", len(body)) + body
    sock.sendall(
        frame(SETTINGS, ACK, 0)
        + frame(HEADERS, END_HEADERS, 1, b"".join(header(k, v) for k, v in headers))
        + frame(DATA, END_STREAM, 1, message)
    )
    return sock


def metric(launcher: LauncherProcess, name: str) -> float:
    value = metric_sample(launcher, name)
    assert value is not None, f"{name} not exposed"
    return value


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    log_dir = tmp_path_factory.mktemp("slow-clients")
    args = ["--max-concurrent-requests", str(MAX_CONCURRENT)]
    env = {"TGIS_STREAM_STALL_TIMEOUT": str(STALL_TIMEOUT_S)}
    with healthy_launcher(log_dir, args, env) as launcher:
        yield launcher


def test_a_client_that_stops_reading_is_cut_off_and_holds_nothing(
    launcher: LauncherProcess,
) -> None:
    (router,) = launcher.process_pids()["router"]
    rss_before = resident_kib(router)
    details = pb.ResponseOptions(
        generated_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=10
    )
    params = greedy(1000)
    params.response.CopyFrom(details)
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="Once upon a time"), params=params
    )
    with grpc.insecure_channel(launcher.grpc_target) as channel, ExitStack() as sockets:
        stub = pb_grpc.GenerationServiceStub(channel)
        for _ in range(STALLED):
            sockets.enter_context(closing(stalled_stream(launcher.grpc_port, request)))
        wait_until(lambda: metric(launcher, "tgi_batch_current_size") == STALLED, timeout=30)
        # The batch goes on: a request of a reading client is served beside them.
        served = stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="Hello")], params=greedy(20)
            ),
            timeout=60,
        )
        assert served.responses[0].generated_token_count == 20
        assert "took no message" not in launcher.log_tail(50000), "cut off before the check"
        # Each stalled stream is cancelled once a message has waited past the limit.
        wait_until(
            lambda: launcher.log_tail(50000).count("took no message") == STALLED,
            timeout=STALL_TIMEOUT_S + 60,
        )
        rss_peak = resident_kib(router)
        wait_until(lambda: metric(launcher, "tgi_batch_current_size") == 0, timeout=30)
        assert metric(launcher, "tgi_queue_size") == 0
        assert metric(launcher, "tgi_kv_cache_used_blocks") == 0
        # Every permit is back: the limit's worth of streams at once, and no more.
        started = [start_stream(channel, 50, started_after=1) for _ in range(MAX_CONCURRENT)]
        for stream in started:
            assert stream.started.wait(60)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(
                pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="Hi")], params=greedy(2)
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in started:
            stream.join(60)
            assert stream.error is None and stream.tokens == 50, stream.error
    assert rss_before is not None and rss_peak is not None
    growth_mib = (rss_peak - rss_before) / 1024
    print(f"router RSS {rss_before / 1024:.0f} -> {rss_peak / 1024:.0f} MiB, {STALLED} stalled")
    # Each stalled stream holds at most its 1,000 token events until it is cut off.
    assert growth_mib < 32, growth_mib
