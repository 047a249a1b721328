"""`text-generation-launcher`: validate the configuration, start one shard per rank and the
router, and supervise them until a signal or a failure.

Modules, one job each:

* `cli` — click flags (and their env vars) → `config.LauncherConfig`;
* `config` — the configuration types (`LauncherConfig`, `ResolvedConfig`), defaults, `ConfigError`;
* `validation` — checks on the flags alone (accepted words, ranges, batching, TLS files);
* `environment` — shard count, HF cache and removed variables, from the environment;
* `model_config` — the model directory and its config.json's max_sequence_length;
* `resolution` — all of these in order → `config.ResolvedConfig`;
* `tokenizer` — the tokenizer.json handed to the router (converted with transformers if missing);
* `commands` — the exact shard and router command lines and environments;
* `health` — shard readiness (socket present and a gRPC Health call answered);
* `output` — re-printing children's output lines with a `Shard 0: ` / `Router: ` prefix;
* `supervisor` — starting, watching and stopping the child processes (process groups);
* `app` — the start-up sequence tying these together; `logs` — the launcher's own logging.
"""
