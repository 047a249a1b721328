"""The recurrent-state slots of a model with Mamba layers (Granite 4.0 hybrid), sized at
start-up, and what such a model turns off: prefix caching (a sequence's state after a
cached prefix is not kept per block) and speculative decoding (drafts would advance the
state past tokens that may be rejected, and the state cannot be rolled back)."""

from __future__ import annotations

import logging

import torch

from tgis.shard.capacity import configured_state_slots, device_memory
from tgis.shard.config import ShardConfig
from tgis.shard.native.models import CausalLM
from tgis.shard.native.models.recurrent_state import RecurrentStates, StateSpec
from tgis.shard.parallel.distributed import min_over_ranks
from tgis.shard.parallel.group import SINGLE, TensorParallel

log = logging.getLogger(__name__)


def recurrent_states(
    config: ShardConfig, model: CausalLM, device: torch.device, tp: TensorParallel = SINGLE
) -> RecurrentStates | None:
    """The model's pool of state slots (None for a model without recurrent state): one
    per sequence the batch may hold, as many as fit (``capacity.configured_state_slots``)
    on every rank."""
    spec: StateSpec | None = getattr(model, "state_spec", None)
    if spec is None:
        return None
    memory = device_memory(device)
    slots = configured_state_slots(config.max_batch_size, spec.bytes_per_slot, memory)
    slots = min_over_ranks(tp, slots)
    log.info(
        "Recurrent state: %d slots of %.2f MiB (%d Mamba layers), at most %d sequences run "
        "at once; prefix caching and speculative decoding are off for this model (a "
        "sequence's state is neither kept per cached block nor rolled back from rejected "
        "drafts); its step runs eagerly, without CUDA graphs",
        slots,
        spec.bytes_per_slot / 2**20,
        spec.num_layers,
        slots,
    )
    if config.speculator_name:
        log.warning(
            "--speculator-name %s ignored: no speculative decoding for a model with "
            "recurrent state",
            config.speculator_name,
        )
    return RecurrentStates(spec, slots, device)
