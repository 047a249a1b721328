"""The native paged engine: ``ModelRunner``, its paged KV cache and block tables, the
attention backends, the model families and their tensor-parallel layers, the lock-step
ranks, the GPU capacity measurement, the compiled step and decode CUDA graphs."""
