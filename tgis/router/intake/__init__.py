"""Intake: what happens to a call before its inputs are queued (permits, limits,
parameter and input validation, tokenization, adapter and prompt-prefix resolution)."""
