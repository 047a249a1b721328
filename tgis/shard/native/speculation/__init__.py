"""Speculative decoding's drafters on the shard: a draft model (its drafting steps,
``draft_model``, and its loading, ``draft_loading``) or an MLP speculator drafting from the
target's hidden rows (``mlp_speculator``, ``mlp_drafter``)."""
