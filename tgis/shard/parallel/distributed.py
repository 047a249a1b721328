"""Join the ranks of one model into a torch.distributed group, and the control collectives.

Every shard process of a `--num-shard N` launch calls `init_distributed` once before loading
its weights. The default process group (the tensor collectives of the layers) uses NCCL when
CUDA is available (device `cuda:LOCAL_RANK`) and gloo on CPU, so CPU runs exercise the same
code. A second group, always gloo, carries rank 0's commands and each rank's outcome as
CPU tensors of bytes (``broadcast_command``, ``gather_payloads``; start-up's few values as
pickled objects): its collectives wait without a timeout, because an idle server may not
send a command for hours; a rank that dies still ends them at once (the connection closes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tgis.settings.serving import DEFAULT_DISTRIBUTED_TIMEOUT_S
from tgis.shard.config import env_int
from tgis.shard.errors import StartupError
from tgis.shard.parallel.group import SINGLE, TensorParallel

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=3650)
"""The object group's collective timeout: in effect none."""


def backend_for(cuda: bool) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if cuda else "gloo"


def init_distributed(
    rank: int,
    world_size: int,
    local_rank: int | None = None,
    timeout_s: float | None = None,
    cuda: bool | None = None,
) -> TensorParallel:
    """Join the `world_size` ranks at MASTER_ADDR:MASTER_PORT; `SINGLE` for one rank.

    `local_rank` (default: env LOCAL_RANK, else `rank`) picks the GPU; `timeout_s` (the
    shard's ``--distributed-timeout``, TGIS_DISTRIBUTED_TIMEOUT_S) defaults to
    DEFAULT_DISTRIBUTED_TIMEOUT_S. Raises StartupError (one line)
    when the environment is incomplete or this rank cannot join within the timeout (a peer
    never started, the port is taken, ...).
    """
    if world_size == 1:
        return SINGLE
    return join_group(rank, world_size, local_rank, timeout_s, cuda)


def join_group(
    rank: int,
    world_size: int,
    local_rank: int | None = None,
    timeout_s: float | None = None,
    cuda: bool | None = None,
) -> TensorParallel:
    """``init_distributed`` without its one-rank shortcut (tests join a group of one)."""
    if local_rank is None:
        local_rank = env_int("LOCAL_RANK", rank)
    if timeout_s is None:
        timeout_s = DEFAULT_DISTRIBUTED_TIMEOUT_S
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise StartupError("MASTER_ADDR and MASTER_PORT must be set when WORLD_SIZE > 1")
    use_cuda = torch.cuda.is_available() if cuda is None else cuda
    backend = backend_for(use_cuda)
    timeout = timedelta(seconds=timeout_s)
    options: dict[str, Any] = {}
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        options["device_id"] = device  # eager NCCL communicator: failures show at start-up
    try:
        dist.init_process_group(
            backend,
            init_method="env://",  # MASTER_ADDR, MASTER_PORT
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **options,
        )
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except Exception as e:
        destroy()
        raise StartupError(
            f"rank {rank} of {world_size} could not join the {backend} group at "
            f"{addr}:{port} within {timeout_s:g} s: {first_line(e)}"
        ) from None
    log.info("Rank %d of %d joined the %s group at %s:%s", rank, world_size, backend, addr, port)
    return TensorParallel(rank=rank, world_size=world_size, group=None, control_group=control)


def destroy() -> None:
    """Leave and free every process group of this process (no-op when none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


COMMAND_BYTES = 4096
"""The size of the tensor every command is broadcast in: a (command, payload length) header
of two int64s, then as much of the payload as fits (a second broadcast carries the rest)."""

_COMMAND_HEADER = struct.Struct("<qq")


def broadcast_command(
    tp: TensorParallel, command: int = 0, payload: bytes = b""
) -> tuple[int, bytes]:
    """Rank 0's (`command`, `payload`) on every rank (others pass nothing): one broadcast of a
    COMMAND_BYTES uint8 tensor, and one more only for a payload that does not fit."""
    room = COMMAND_BYTES - _COMMAND_HEADER.size
    if tp.rank == 0:
        buffer = bytearray(COMMAND_BYTES)
        _COMMAND_HEADER.pack_into(buffer, 0, command, len(payload))
        buffer[_COMMAND_HEADER.size : _COMMAND_HEADER.size + len(payload[:room])] = payload[:room]
        head = torch.frombuffer(buffer, dtype=torch.uint8)
    else:
        head = torch.empty(COMMAND_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=0, group=tp.control_group)
    if tp.rank == 0:
        rest = payload[room:]
        if rest:
            dist.broadcast(
                torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=tp.control_group
            )
        return command, payload
    data = head.numpy().tobytes()
    command, length = _COMMAND_HEADER.unpack_from(data)
    payload = data[_COMMAND_HEADER.size : _COMMAND_HEADER.size + min(length, room)]
    if length > room:
        rest_tensor = torch.empty(length - room, dtype=torch.uint8)
        dist.broadcast(rest_tensor, src=0, group=tp.control_group)
        payload += rest_tensor.numpy().tobytes()
    return command, payload


def gather_payloads(tp: TensorParallel, payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank. The ranks first exchange each
    payload's length and digest (one int64 pair each); only when they differ do the payloads
    themselves travel (a second all-gather, padded to the longest)."""
    digest = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little", signed=True)
    mine = torch.tensor([len(payload), digest], dtype=torch.int64)
    summaries = [torch.empty_like(mine) for _ in range(tp.world_size)]
    dist.all_gather(summaries, mine, group=tp.control_group)
    rows = [tuple(t.tolist()) for t in summaries]
    if all(row == rows[0] for row in rows):
        return [payload] * tp.world_size
    longest = max(length for length, _ in rows)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(padded) for _ in range(tp.world_size)]
    dist.all_gather(parts, padded, group=tp.control_group)
    return [part.numpy().tobytes()[:length] for part, (length, _) in zip(parts, rows, strict=True)]


def gather_objects(tp: TensorParallel, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (pickled: start-up only)."""
    out: list[Any] = [None] * tp.world_size
    dist.all_gather_object(out, obj, group=tp.control_group)
    return out


def first_failure(tp: TensorParallel, error: str) -> str:
    """The lowest failing rank's error among every rank's (``error``: this rank's, "" for
    none), as "rank N: error"; "" when no rank failed. One gather: every rank then decides
    the same (e.g. all run eagerly when one could not compile its step)."""
    if not tp.is_parallel:
        return error
    for rank, text in enumerate(gather_objects(tp, error)):
        if text:
            return f"rank {rank}: {text}"
    return ""


def min_over_ranks(tp: TensorParallel, value: int) -> int:
    """The smallest `value` of all ranks (e.g. KV blocks that fit on every GPU)."""
    if not tp.is_parallel:
        return value
    return int(min(gather_objects(tp, value)))


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (c10d appends C++ stack traces)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
