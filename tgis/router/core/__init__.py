"""The core loop: the engine's step pipeline, the scheduler and its KV-block accounting,
each request's state with its detokenizer and stop checks, and the shard client."""
