"""The router process: public gRPC API, validation, tokenization, scheduling, detokenization.

Never imports torch.
"""
