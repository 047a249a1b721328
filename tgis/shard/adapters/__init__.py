"""Stores a request can name, and what a step needs of them: safe resolution of ids inside
a store (``store_paths``); TGIS prompt-tuning prefixes (``prefix_store`` loads, checks and
caches them, ``prefixes`` gives a sequence its embeddings); PEFT adapters of
``ADAPTER_CACHE`` (``adapter_cache``: LoRA read by ``lora_store`` into the form of
``lora_layout``, prompt tuning through a ``PrefixStore``; ``request_adapters`` gives a
sequence its LoRA weights or virtual tokens)."""
