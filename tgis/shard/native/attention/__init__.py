"""Paged attention: the KV cache (``kv_cache``), each step's layout in it (``block_tables``:
``flatten`` to a ``BatchLayout``), and the backends that attend over it: what they share
(``interface``), the pure-torch reference (``torch_paged``), the C-accelerated CPU default
(``cpu_paged``), Triton kernels for CUDA (``triton_paged`` over ``triton_kernels`` and
``triton_split``), the varlen backends (``varlen``), and the choice made once at start-up
(``selection``)."""
