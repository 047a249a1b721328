"""Start-up: the runner built from a model's files (``loader``: ``load_native_runner``), the
form of its forward (``forward``: eager, compiled, CUDA graphs) and the GPU warm-up that
measures the KV capacity (``cuda_capacity``)."""
