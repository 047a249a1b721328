"""router/startup.py: what the router says once about the engine it got."""

from __future__ import annotations

import dataclasses

import pytest

from tests.router.core.scripted_shard import INFO
from tgis.router.core.speculation import SpeculationConfig
from tgis.router.startup import log_prefix_caching, log_speculation


@pytest.mark.parametrize(
    ("speculation", "info_fields", "says"),
    [
        (None, {}, "speculative decoding: off (--speculate 0)"),
        (SpeculationConfig(4), {"speculation": False}, "does not verify drafts"),
        (
            SpeculationConfig(4),
            {"speculation": False, "state_slots": 8},
            "off, the model keeps recurrent state",
        ),
        (SpeculationConfig(4), {"speculation": True}, "drafted by prompt lookup"),
        (
            SpeculationConfig(4),
            {"speculation": True, "draft_model": True},
            "drafted on the shard by --speculator-name (a draft model or an MLP speculator)",
        ),
    ],
)
def test_the_speculation_line_names_where_drafts_come_from(
    caplog: pytest.LogCaptureFixture,
    speculation: SpeculationConfig | None,
    info_fields: dict[str, int],
    says: str,
) -> None:
    info = dataclasses.replace(INFO, **info_fields)
    with caplog.at_level("INFO", logger="tgis.router.startup"):
        log_speculation(speculation, info)
    (line,) = [r.getMessage() for r in caplog.records]
    assert says in line
    if info_fields.get("draft_model"):
        assert "prompt lookup" not in line


def test_prefix_caching_off_for_a_model_with_recurrent_state_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    info = dataclasses.replace(INFO, prefix_caching=False, state_slots=8)
    with caplog.at_level("INFO", logger="tgis.router.startup"):
        log_prefix_caching(True, info)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "off, the model keeps recurrent state" in line
