"""The forward captured whole: under ``torch.compile`` (``compiled``) and as CUDA graphs of
the decode and verify steps (``cuda_graphs``)."""
