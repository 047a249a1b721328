"""Settings of how much is served at once: request limits, batching, KV-cache capacity."""

from __future__ import annotations

from tgis.settings.declaration import Kind, Process
from tgis.settings.declaration import setting as _s

L, R, S = Process.LAUNCHER, Process.ROUTER, Process.SHARD

MAX_STOP_SEQUENCES = 6
"""TGIS's limit on the stop sequences of one request (TGI's is 4)."""
MAX_BEST_OF = 1
"""Each choice is one generated sequence (TGI's default limit is 2)."""

LIMITS = (
    _s("max_concurrent_requests", ("--max-concurrent-requests",), ("MAX_CONCURRENT_REQUESTS",),
       Kind.INT, 512,
       "Inputs in flight (queued or running); more are refused with `Model is overloaded`.",
       {L, R}),
    _s("max_sequence_length", ("--max-sequence-length", "--max-total-tokens"),
       ("MAX_SEQUENCE_LENGTH", "MAX_TOTAL_TOKENS"), Kind.INT, None,
       "Input + output tokens of one request (default: from the model's config.json, else "
       "2048).", {L, R, S}, defaults={R: 2048, S: 2048},
       aliases={"--max-total-tokens": "TGI", "MAX_TOTAL_TOKENS": "TGI"}),
    _s("max_new_tokens", ("--max-new-tokens",), ("MAX_NEW_TOKENS",), Kind.INT, 1024,
       "Largest max_new_tokens a request may ask for.", {L, R, S}),
    _s("max_input_tokens", ("--max-input-tokens", "--max-input-length"),
       ("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"), Kind.INT, None,
       "Longest input in tokens, after truncation (default: max-sequence-length - 1).",
       {L, R}, aliases={"--max-input-length": "TGI", "MAX_INPUT_LENGTH": "TGI"}),
    _s("max_client_batch_size", ("--max-client-batch-size",), ("MAX_CLIENT_BATCH_SIZE",),
       Kind.INT, None, "Most inputs in one Generate call (default: no limit).", {L, R}),
    _s("max_stop_sequences", ("--max-stop-sequences",), ("MAX_STOP_SEQUENCES",), Kind.INT,
       MAX_STOP_SEQUENCES, "Most stop sequences one request may give (TGIS's limit: 6).",
       {L, R}, minimum=0),
    _s("max_top_n_tokens", ("--max-top-n-tokens",), ("MAX_TOP_N_TOKENS",), Kind.INT, None,
       "Largest top_n_tokens (OpenAI: top_logprobs, logprobs) a request may ask for "
       "(default: no limit, as TGIS).", {L, R}, minimum=0),
    _s("max_best_of", ("--max-best-of",), ("MAX_BEST_OF",), Kind.INT, MAX_BEST_OF,
       "Largest best_of a request may ask for; one sequence is generated per choice, so "
       "best_of above 1 is refused whatever the limit.", {L, R}, minimum=1),
)  # fmt: skip

BATCHING = (
    _s("max_batch_size", ("--max-batch-size",), ("MAX_BATCH_SIZE",), Kind.INT, None,
       "Most sequences in the running batch (default: by capacity, as many as the KV cache "
       "holds, at most 256).", {L, R, S}),
    _s("max_prefill_padding", ("--max-prefill-padding",), ("MAX_PREFILL_PADDING",), Kind.FLOAT,
       0.2, "Accepted for TGIS compatibility; the paged engine never pads.", {L, R}),
    _s("max_waiting_tokens", ("--max-waiting-tokens",), ("MAX_WAITING_TOKENS",), Kind.INT, None,
       "Steps after which queued requests join the running batch whatever their number (0: "
       "at the next step). Default: unset; with --waiting-served-ratio also unset, queued "
       "requests join at the next step (chunked prefill bounds their cost), else 24.", {L, R}),
    _s("waiting_served_ratio", ("--waiting-served-ratio",), ("WAITING_SERVED_RATIO",),
       Kind.FLOAT, None,
       "Queued requests join a running batch of n sequences at once when at least "
       "floor(n × ratio) of them can (default 1.2 when --max-waiting-tokens is set).", {L, R}),
    _s("max_batch_prefill_tokens", ("--max-batch-prefill-tokens", "--max-batch-tokens"),
       ("MAX_BATCH_PREFILL_TOKENS", "MAX_BATCH_TOKENS"), Kind.INT, None,
       "Prompt tokens computed per step; longer prompts are prefilled in chunks alongside the "
       "decodes (default 4096, 512 on a CPU shard, or --max-batch-total-tokens if smaller). "
       "The GPU warm-up runs a prefill this large.", {L, R, S}, defaults={S: 4096},
       aliases={"--max-batch-tokens": "earlier tgis", "MAX_BATCH_TOKENS": "earlier tgis"}),
    _s("max_batch_total_tokens", ("--max-batch-total-tokens",), ("MAX_BATCH_TOTAL_TOKENS",),
       Kind.INT, None,
       "KV-cache tokens of the running batch (default: what fits in memory on GPU; "
       "TGIS_KV_CACHE_BLOCKS or batch size × sequence length on CPU).", {L, R, S}),
)  # fmt: skip

CAPACITY = (
    _s("batch_safety_margin", ("--batch-safety-margin",), ("BATCH_SAFETY_MARGIN",), Kind.INT, 20,
       "Percentage of free GPU memory held back when sizing the KV cache.", {L, S}),
    _s("cuda_process_memory_fraction",
       ("-c", "--cuda-process-memory-fraction", "--cuda-memory-fraction"),
       ("CUDA_PROCESS_MEMORY_FRACTION", "CUDA_MEMORY_FRACTION"), Kind.FLOAT, 1.0,
       "Fraction of GPU memory a shard may use, 0 < x <= 1.", {L, S},
       aliases={"--cuda-memory-fraction": "TGI", "CUDA_MEMORY_FRACTION": "TGI"}),
    _s("kv_cache_blocks", ("--kv-cache-blocks",), ("TGIS_KV_CACHE_BLOCKS",), Kind.INT, None,
       "Number of 16-token KV blocks (on GPU it replaces the warm-up measurement; on CPU "
       "the default is --max-batch-total-tokens, else batch size × sequence length, else "
       "1 GiB or a quarter of the available memory).", {S}, minimum=1),
)  # fmt: skip

SETTINGS = (*LIMITS, *BATCHING, *CAPACITY)
