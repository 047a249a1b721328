"""Quantized checkpoints: which scheme a model has (``scheme.py``), each format's layout
(``gptq.py``, ``awq.py``, ``compressed_tensors.py``, ``fp8.py``, ``at_load.py``) read into
one form (``matrix.py``), and the reader for a scheme (``readers.py``)."""
