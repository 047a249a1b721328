"""Settings of what a request may use: output rules, the prefix cache, speculation, LoRA and
prompt-tuning adapters, TGIS prompt prefixes."""

from __future__ import annotations

from tgis.settings.declaration import Kind, Process
from tgis.settings.declaration import setting as _s

L, R, S = Process.LAUNCHER, Process.ROUTER, Process.SHARD

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
DEFAULT_SPECULATOR_MAX_BATCH_SIZE = 16  # TGIS's SPECULATOR_MAX_BATCH_SIZE default
DEFAULT_PROMPT_CACHE_MB = 512  # TGIS's PROMPT_CACHE_SIZE_MB default

OUTPUT = (
    _s("output_special_tokens", ("--output-special-tokens",), ("OUTPUT_SPECIAL_TOKENS",),
       Kind.FLAG, False, "Keep special tokens in output text.", {L, R}),
    _s("default_include_stop_seqs", ("--default-include-stop-seqs",),
       ("DEFAULT_INCLUDE_STOP_SEQS",), Kind.BOOL, True,
       "Default of include_stop_sequence (takes a value: true/false).", {L, R}),
)  # fmt: skip

CACHING_AND_SPECULATION = (
    _s("disable_prefix_caching", ("--disable-prefix-caching",), ("DISABLE_PREFIX_CACHING",),
       Kind.FLAG, False,
       "Compute every prompt in full: no reuse of cached KV blocks of earlier prompts.",
       {L, R, S}),
    _s("speculate", ("--speculate",), ("SPECULATE",), Kind.INT, 0,
       "Speculative decoding: tokens drafted per sequence and step, by prompt lookup (n-grams "
       "of the prompt and the output) or a draft model; 0 turns it off.", {L, R, S},
       minimum=0),
    _s("speculator_name", ("--speculator-name",), ("SPECULATOR_NAME",), Kind.STR, None,
       "A draft model sharing the model's tokenizer (a directory or a cached model id): it "
       "drafts the tokens instead of prompt lookup; --speculate then defaults to 4.", {L, S}),
    _s("speculator_max_batch_size", ("--speculator-max-batch-size",),
       ("SPECULATOR_MAX_BATCH_SIZE",), Kind.INT, DEFAULT_SPECULATOR_MAX_BATCH_SIZE,
       "Speculate only while at most this many sequences run (the verify steps' CUDA graphs "
       "go up to that batch size).", {L, R, S}, minimum=1),
    _s("speculate_always", ("--speculate-always",), ("SPECULATE_ALWAYS",), Kind.FLAG, False,
       "Draft in every step while speculation applies, whatever the sequences' recent "
       "acceptance (TGIS's way); by default a sequence drafts only as far as its recent "
       "acceptance pays for, and not while its drafts fail.", {L, R}),
    _s("prompt_lookup_min", ("--prompt-lookup-min",), ("PROMPT_LOOKUP_MIN",), Kind.INT, 1,
       "Shortest suffix, in tokens, prompt lookup searches for.", {L, R}, minimum=1),
    _s("prompt_lookup_max", ("--prompt-lookup-max",), ("PROMPT_LOOKUP_MAX",), Kind.INT, 3,
       "Longest suffix, in tokens, prompt lookup searches for.", {L, R}, minimum=1),
)  # fmt: skip

ADAPTERS = (
    _s("adapter_cache", ("--adapter-cache",), ("ADAPTER_CACHE",), Kind.STR, None,
       "Directory of PEFT adapters (LoRA or prompt tuning, each a directory with "
       "adapter_config.json) that requests name with adapter_id; loaded on first use. Unset: "
       "adapter_id is refused.", {L, S}),
    _s("lora_adapters", ("--lora-adapters",), ("LORA_ADAPTERS",), Kind.STR, None,
       "Adapters of --adapter-cache to load at start, comma-separated ids (LoRA or prompt "
       "tuning), so that no request waits for their loading; one that cannot be loaded stops "
       "the start.", {L, S}, aliases={"--lora-adapters": "TGI", "LORA_ADAPTERS": "TGI"}),
    _s("max_loras", ("--max-loras",), ("MAX_LORAS",), Kind.INT, DEFAULT_MAX_LORAS,
       "Most different LoRA adapters in one step (requests for others wait); also how many "
       "stay loaded when unused.", {L, S}, minimum=1),
    _s("max_lora_rank", ("--max-lora-rank",), ("MAX_LORA_RANK",), Kind.INT,
       DEFAULT_MAX_LORA_RANK, "The largest LoRA rank accepted (larger adapters are refused).",
       {L, S}, minimum=1),
    _s("prefix_store_path", ("--prefix-store-path",), ("PREFIX_STORE_PATH",), Kind.STR, None,
       "Directory of TGIS prompt-tuning prefixes for prefix_id (unset: every prefix_id is not "
       "found).", {S}),
    _s("prompt_cache_size_mb", ("--prompt-cache-size-mb",), ("PROMPT_CACHE_SIZE_MB",),
       Kind.INT, DEFAULT_PROMPT_CACHE_MB,
       "Megabytes of loaded prefixes the shard keeps (least recently used out).", {S},
       minimum=0),
    _s("max_prompt_prefix_length", ("--max-prompt-prefix-length",),
       ("MAX_PROMPT_PREFIX_LENGTH",), Kind.INT, None,
       "Longest prefix accepted (default: half of --max-sequence-length).", {S}, minimum=1),
)  # fmt: skip

SETTINGS = (*OUTPUT, *CACHING_AND_SPECULATION, *ADAPTERS)


def adapter_ids(value: str | None) -> tuple[str, ...]:
    """The ids of ``--lora-adapters``: comma-separated, blanks around them and empty ones
    dropped, each once, in order."""
    ids = (part.strip() for part in (value or "").split(","))
    return tuple(dict.fromkeys(i for i in ids if i))
