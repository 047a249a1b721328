"""Start-up: the runner built from a model's files (``loader``: ``load_native_runner``) and
the GPU warm-up that measures the KV capacity (``cuda_capacity``)."""
