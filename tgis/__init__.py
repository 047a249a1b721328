"""tgis: a gRPC-first LLM inference server, drop-in compatible with IBM TGIS.

Processes: the launcher (`tgis.launcher`) starts one shard process per tensor-parallel
rank (`tgis.shard`, owns the model and the KV tensors) and the router (`tgis.router`,
owns the API, validation, tokenization, scheduling, KV-block accounting, detokenization
and stopping). The router never imports torch.

The life of a request, as types:
GenerationRequest (pb) -> ValidatedRequest -> RequestState -> StepPlan -> shard Step (pb)
-> StepOutput -> TokenEvent -> GenerationResponse (pb). See ARCHITECTURE.md.
"""

__version__ = "0.1.0"
