"""A ``Kind.LIST`` setting (``--cors-allow-origin``, as TGI's): the flag repeated or its
values comma-separated, from the command line or the environment, reaches the router as
one tuple, through the launcher's forwarding too."""

from __future__ import annotations

from typing import Any

import pytest

from tgis.router import cli as router_cli
from tgis.settings.declaration import Process
from tgis.settings.forwarding import child_argv


def router_params(argv: list[str]) -> dict[str, Any]:
    argv = [*argv, "--tokenizer-path", "/t/tokenizer.json"]
    return dict(router_cli.main.make_context("text-generation-router", argv).params)


def test_repeated_and_comma_separated_values_are_one_tuple(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CORS_ALLOW_ORIGIN", raising=False)
    assert router_params([])["cors_allow_origin"] == ()
    argv = [
        "--cors-allow-origin",
        "https://a.example",
        "--cors-allow-origin",
        " b , ,https://a.example,c",
    ]
    assert router_params(argv)["cors_allow_origin"] == ("https://a.example", "b", "c")
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "https://x.example,https://y.example")
    params = router_params([])
    assert params["cors_allow_origin"] == ("https://x.example", "https://y.example")
    config = router_cli.router_config(params)
    assert config.cors_allow_origin == ("https://x.example", "https://y.example")


def test_the_launcher_forwards_a_list_as_one_value() -> None:
    words = child_argv(Process.ROUTER, {"cors_allow_origin": ("https://a.example", "*")})
    assert words == ["--cors-allow-origin", "https://a.example,*"]
    assert child_argv(Process.ROUTER, {"cors_allow_origin": ()}) == []
