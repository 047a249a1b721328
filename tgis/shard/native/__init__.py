"""The native paged engine: ``ModelRunner``, its paged KV cache and block tables, the
attention backends, the model families, tensor parallelism, capacity, the compiled step
and decode CUDA graphs."""
