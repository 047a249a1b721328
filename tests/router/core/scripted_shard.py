"""A scripted stand-in for the shard's step channel, and an engine built on it, for the
tests that run the router's engine loop in-process (core/test_engine.py, and the correlation
ids of ops/test_request_context.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tgis.embedded_model import MODEL_DIR
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.engine import Engine
from tgis.router.core.request_state import OutputRules
from tgis.router.core.scheduler import new_scheduler
from tgis.router.core.shard_client import ShardError, ShardFailure
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)
from tgis.shard_api.messages import (
    ModelKind,
    SampledToken,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
)

EOS = 2
INFO = ShardInfo(
    model_kind=ModelKind.CAUSAL_LM,
    eos_token_ids=(EOS,),
    vocab_size=4096,
    block_size=16,
    num_blocks=64,
    world_size=1,
    max_position_embeddings=1024,
    model_type="llama",
    dtype="float32",
    device="cpu",
    attention_backend="scripted",
)


class ScriptedShard:
    """Runs sent steps in order, returning token `300 + step` for every sequence that has
    caught up; records plans and checks them like the real shard (a broken plan fails the
    step with an error; a plan built on a step that failed is refused as stale)."""

    def __init__(
        self,
        fail_at_step: int | None = None,
        eos_at_step: int | None = None,
        failure: ShardFailure = ShardFailure.ERROR,
        oom_when: Callable[[StepPlan], bool] | None = None,
        hang_at_step: int | None = None,
        lost_at_step: int | None = None,
    ):
        self.plans: list[StepPlan] = []
        self.seqs: dict[int, list[int]] = {}  # request id -> [known tokens, computed]
        self.fail_at_step = fail_at_step
        self.eos_at_step = eos_at_step
        self.failure = failure
        self.oom_when = oom_when
        self.hang_at_step = hang_at_step  # this step and every later one never answer
        self.lost_at_step = lost_at_step  # from this step on, every send fails at once
        self.sent = 0
        self.last_completed = 0
        self.stale: list[int] = []
        self._queue: asyncio.Queue[tuple[StepPlan, asyncio.Future[StepOutput]]] | None = None

    def send_step(self, plan: StepPlan) -> asyncio.Future[StepOutput]:
        self.sent += 1
        if self.lost_at_step is not None and plan.step_id >= self.lost_at_step:
            lost: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
            lost.set_exception(ShardError(ShardFailure.CONNECTION, "step channel closed"))
            return lost  # as the real channel's future once its connection is gone
        if self._queue is None:
            self._queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._work())
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((plan, future))
        return future

    async def step_result(self, future: asyncio.Future[StepOutput]) -> StepOutput:
        return await future

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            plan, future = await self._queue.get()
            await asyncio.sleep(0.001)
            if future.cancelled():
                continue
            if self.hang_at_step is not None and plan.step_id >= self.hang_at_step:
                continue
            try:
                future.set_result(self._run(plan))
                self.last_completed = plan.step_id
            except ShardError as err:
                future.set_exception(err)

    def _run(self, plan: StepPlan) -> StepOutput:
        if plan.base_step_id and plan.base_step_id != self.last_completed:
            self.stale.append(plan.step_id)
            raise ShardError(ShardFailure.STALE, "stale")
        self.plans.append(plan)
        for rid in plan.finished_request_ids:
            self.seqs.pop(rid, None)
        for rid in plan.preempted_request_ids:
            if rid in self.seqs:
                self.seqs[rid][1] = 0
        if plan.step_id == self.fail_at_step:
            raise ShardError(self.failure, "GPU out of memory")
        if self.oom_when is not None and self.oom_when(plan):
            raise ShardError(ShardFailure.OOM, "GPU out of memory")
        for seq in plan.new_sequences:
            assert seq.request_id not in self.seqs
            # A prompt prefix's virtual tokens are positions of the prompt too.
            self.seqs[seq.request_id] = [seq.prompt_length, 0]
        tokens = []
        for chunk in plan.scheduled:
            known = self.seqs[chunk.request_id]
            assert 1 <= chunk.num_tokens <= known[0] - known[1], (chunk, known)
            known[1] += chunk.num_tokens
            if known[1] == known[0]:
                known[0] += 1  # the sampled token is computed next step
                token = EOS if plan.step_id == self.eos_at_step else 300 + plan.step_id
                tokens.append(SampledToken(chunk.request_id, TokenDetail(token)))
        return StepOutput(plan.step_id, tuple(tokens), forward_time_ns=1000)

    async def health(self) -> None:
        return None


def request(
    max_new_tokens: int, deadline: float | None = None, prefix: int = 0
) -> ValidatedRequest:
    stopping = StoppingParams(max_new_tokens=max_new_tokens, deadline=deadline)
    sampling = SamplingParams()
    return ValidatedRequest(
        text="hello",
        input_ids=(1, 50, 60),
        params=GenerationParams(sampling, stopping, ResponseOptions()),
        stopping=stopping,
        sampling=sampling,
        prefix_id="p" if prefix else "",
        prefix_length=prefix,
    )


def make_engine(
    shard: ScriptedShard,
    batch_tokens: int = 4096,
    info: ShardInfo = INFO,
    batch_size: int = 4,
    start: bool = True,
    step_timeout: float = 600.0,
) -> Engine:
    engine = Engine(
        shard=shard,  # type: ignore[arg-type]
        scheduler=new_scheduler(
            SchedulerLimits(max_batch_size=batch_size, max_batch_prefill_tokens=batch_tokens),
            info,
            prefix_caching=True,
        ),
        output=OutputRules.for_shard(RouterTokenizer(str(MODEL_DIR / "tokenizer.json")), info),
        metrics=Metrics(max_sequence_length=1024, max_new_tokens=1023, max_batch_size=batch_size),
        step_timeout=step_timeout,
    )
    if start:
        engine.start()
    return engine
