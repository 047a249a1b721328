"""Tensor-parallel layers: linears, embeddings and the LM head split over the ranks
(``layers``), on the group of ``tgis.shard.parallel``."""
