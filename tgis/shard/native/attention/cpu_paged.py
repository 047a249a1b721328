"""``cpu_paged``: the reference backend with its decode group run by a C kernel that reads
keys and values in place through the block table (``csrc/cpu_attention.c``).

On the CPU, gathering every decoding sequence's context out of the cache before SDPA costs
more than the attention itself: a step of 32 sequences at 150 tokens copies ~10 MB per
layer. The kernel instead walks each sequence's blocks in place: 16 keys at a time for each
query head, a numerically stable softmax in float32, then every value row for each query
head's output (csrc/cpu_attention.c); with a layer's sliding window it reads only the
blocks that hold the last ``window`` keys; with attention sinks (gpt-oss's) each query head's
sink logit joins its softmax's denominator. Prompts and prompt chunks still go through the
reference (``TorchPagedAttention``). Used for float32 and bfloat16 caches (queries, softmax
and output in float32) when the extension was built (``setup.py``; it needs a C compiler at
install time), else the reference runs alone. The kernel shares its (sequence, KV head)
items out between torch's intra-op threads: built with ``-fopenmp``, it binds to the libgomp
torch has loaded, so both use one thread pool; should a second OpenMP runtime be mapped (a
torch build whose libgomp has another soname), it runs on one thread instead of competing
with torch's workers for the cores.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from types import ModuleType

import torch

from tgis.shard.native.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata

log = logging.getLogger(__name__)

# Cache dtypes the kernel reads, and the code it takes for each.
_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> set[str]:
    """Files of the GNU OpenMP runtimes mapped into this process (empty where /proc is
    missing)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in lines if "libgomp" in line.rsplit("/", 1)[-1]}


def load_kernel() -> ModuleType | None:
    """The compiled extension, or None when it was not built."""
    try:
        return importlib.import_module("tgis.shard.native.attention._cpu_attention")
    except ImportError:
        return None


class CpuPagedAttention(TorchPagedAttention):
    """``TorchPagedAttention`` with decodes in the C kernel (float32 or bfloat16 CPU caches)."""

    name = "cpu_paged"
    supports_softcap = True  # the C kernel caps the decode scores; prompts as the reference
    supports_sinks = True  # the C kernel adds each head's sink to the decode softmax
    masks_decodes = False  # the kernel bounds each sequence by its context length

    def __init__(self, block_size: int, kernel: ModuleType) -> None:
        super().__init__(block_size)
        self.kernel = kernel
        runtimes = openmp_runtimes()
        self.shares_torch_threads = len(runtimes) <= 1
        if not self.shares_torch_threads:
            log.warning(
                "cpu_paged: %d OpenMP runtimes are loaded (%s): decode attention runs on one "
                "thread",
                len(runtimes),
                ", ".join(sorted(runtimes)),
            )

    def _decode(  # noqa: PLR0913 - the step's tensors and the layer's options
        self,
        q: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        metadata: TorchPagedMetadata,
        scale: float | None,
        cache_dtype: torch.dtype,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            metadata.decode_tables is None
            or metadata.decode_context is None
            or cache_dtype not in _CACHE_DTYPES
            or q.device.type != "cpu"
        ):
            return super()._decode(
                q, k_blocks, v_blocks, metadata, scale, cache_dtype, window, softcap, sinks
            )
        assert metadata.decode_rows is not None
        if sinks is not None:
            sinks = sinks.float().contiguous()  # [heads], read by the kernel in place
        queries = q[metadata.decode_rows].float().contiguous()  # [decodes, heads, dim]
        seqs, heads, head_dim = queries.shape
        kv_heads = k_blocks.shape[1] // (self.block_size * head_dim)
        out = torch.empty_like(queries)
        tables = metadata.decode_tables
        self.kernel.paged_decode_attention(
            queries.data_ptr(),
            k_blocks.data_ptr(),
            v_blocks.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            metadata.decode_context.data_ptr(),
            seqs,
            heads,
            kv_heads,
            head_dim,
            self.block_size,
            tables.shape[1],
            k_blocks.shape[0],
            metadata.max_context,
            1.0 / math.sqrt(head_dim) if scale is None else scale,
            _CACHE_DTYPES[cache_dtype],
            torch.get_num_threads() if self.shares_torch_threads else 1,
            window or 0,
            softcap or 0.0,
            0 if sinks is None else sinks.data_ptr(),
        )
        return out.to(q.dtype)
