"""Paged attention backends: the interface and reference (``backends``), the C-accelerated
CPU default (``cpu_paged``), Triton kernels for CUDA (``triton_paged``) and the varlen
backends (``varlen``)."""
