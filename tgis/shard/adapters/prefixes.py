"""Prompt-tuning prefixes as the step algorithm sees them: the router's ``PrefixLookup``
answered, and each new sequence given its prefix's embeddings.

``Prefixes`` takes them from the ``PrefixStore`` cache (``PREFIX_STORE_PATH``), or refuses
when no store is set (``NO_PREFIXES``). How a step puts the embeddings in place of the
placeholder tokens is the engine's business (``native/runtime/prefix_rows.py``, and the
transformers fallback's ``fallback/causal.py`` and ``fallback/seq2seq.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tgis.shard.adapters.prefix_store import PrefixEmbeddings, PrefixStore, not_found
from tgis.shard.adapters.store_paths import StoreError
from tgis.shard_api.messages import NewSequence, PrefixInfo


class PrefixUnavailable(Exception):
    """A new sequence's prefix cannot be used: that sequence fails alone."""


def changed_message(what: str) -> str:
    """Why a sequence fails whose prefix or adapter contents are no longer those the
    router looked up (the router looks it up again for the next request)."""
    return (
        f"{what} changed in its store after the router looked it up; the request can be sent again"
    )


@dataclass(frozen=True)
class Prefixes:
    """This rank's prompt-tuning prefixes: a store (None: ``PREFIX_STORE_PATH`` unset,
    every id is not found, as TGIS answers) and the id of the placeholder tokens."""

    store: PrefixStore | None
    placeholder_id: int = 0

    def lookup(self, prefix_id: str) -> PrefixInfo:
        """Load ``prefix_id`` (or find it cached) and return its virtual tokens and version;
        StoreError with TGIS's message otherwise."""
        prefix = self._get(prefix_id)
        return PrefixInfo(prefix.length, prefix.version)

    def embeddings(self, ns: NewSequence) -> PrefixEmbeddings:
        """The embeddings of ``ns``'s prefix: its decoder rows [virtual tokens, hidden]
        and, for encoder-decoder models, its encoder rows (either may be None there, not
        both). Raises PrefixUnavailable when the prefix is missing, malformed, no longer as
        long as the router counted, or (``ns.prefix_version`` set) of other contents."""
        try:
            prefix = self._get(ns.prefix_id)
        except StoreError as e:
            raise PrefixUnavailable(
                f"Error retrieving prompt prefix '{ns.prefix_id}': {e.tgis_message}"
            ) from None
        if prefix.length != ns.prefix_length:
            raise PrefixUnavailable(
                f"prompt prefix '{ns.prefix_id}' has {prefix.length} virtual tokens but the "
                f"router counted {ns.prefix_length} (it changed in the store after the "
                "router looked it up; the router keeps a length for up to an hour)"
            )
        if ns.prefix_version and prefix.version != ns.prefix_version:
            raise PrefixUnavailable(changed_message(f"prompt prefix '{ns.prefix_id}'"))
        return prefix

    def _get(self, prefix_id: str) -> PrefixEmbeddings:
        if self.store is None:
            raise not_found(prefix_id)
        return self.store.get(prefix_id)


NO_PREFIXES = Prefixes(store=None)
"""An engine without a prefix store: every prefix id is not found."""
