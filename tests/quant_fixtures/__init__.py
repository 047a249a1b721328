"""Quantized checkpoints of tiny models, written by the real quantization libraries, and the
transformers-based oracles that read them back (test-side tooling only)."""
