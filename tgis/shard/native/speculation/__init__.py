"""Speculative decoding's draft model: its drafting steps (``draft_model``) and its loading
(``draft_loading``)."""
