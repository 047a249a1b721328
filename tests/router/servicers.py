"""The router's servicer assembled from its parts, as ``tgis/router/server.py`` does, for the
tests that drive it in-process with a stand-in engine or a real one."""

from __future__ import annotations

from typing import Any

from tgis.router.edge.calls import CallGate
from tgis.router.edge.replies import Replies
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.edge.tracing import Tracing
from tgis.router.intake.adapters import AdapterKinds
from tgis.router.intake.admission import Admission
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.stalled_streams import StalledStreams


def make_servicer(
    *,
    engine: Any,
    tokenizer: RouterTokenizer,
    limits: ServerLimits,
    limiter: ConcurrencyLimiter,
    metrics: Metrics,
    default_include_stop_seqs: bool,
    is_seq2seq: bool,
    prefixes: PrefixInfos | None = None,
    adapters: AdapterKinds | None = None,
    drain: Drain | None = None,
    tracing: Tracing | None = None,
    stalled_streams: StalledStreams | None = None,
    grammars: GrammarCompiler | None = None,
) -> GenerationServicer:
    """``engine`` is the real Engine or a stand-in with its ``submit`` and ``abort``."""
    admission = Admission(
        tokenizer=tokenizer,
        limits=limits,
        limiter=limiter,
        metrics=metrics,
        prefixes=prefixes,
        adapters=adapters,
        grammars=grammars,
    )
    return GenerationServicer(
        admission=admission,
        engine=engine,
        replies=Replies(tokenizer=tokenizer, metrics=metrics, is_seq2seq=is_seq2seq),
        calls=CallGate(drain if drain is not None else Drain(), tracing),
        default_include_stop_seqs=default_include_stop_seqs,
        stalled_streams=stalled_streams,
    )
