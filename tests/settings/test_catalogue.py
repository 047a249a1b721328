"""The settings table: each setting declared once, each program's options exactly the
settings it reads, and every value the launcher holds reaching each child that reads it,
through the launcher's forwarding, the child's own command line and its configuration."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest

import tgis
from tgis.launcher import cli as launcher_cli
from tgis.launcher.commands import router_values, shard_values
from tgis.launcher.config import LauncherConfig
from tgis.launcher.resolution import resolve
from tgis.router import cli as router_cli
from tgis.router.config import RouterConfig
from tgis.settings import catalogue
from tgis.settings.catalogue import SETTINGS, read_by
from tgis.settings.declaration import UNSET, Kind, Process, Setting, setting
from tgis.settings.forwarding import child_argv, child_env
from tgis.shard import cli as shard_cli
from tgis.shard.config import EngineSettings, ShardConfig

L, R, S = Process.LAUNCHER, Process.ROUTER, Process.SHARD

COMMANDS: dict[Process, click.Command] = {
    L: launcher_cli.command,
    R: router_cli.main,
    S: shard_cli.serve,
}

# Values that pass each program's checks where an arbitrary one would not.
VALID_SAMPLES: dict[str, object] = {
    "max_sequence_length": 300,
    "max_batch_total_tokens": 4096,
    "max_batch_prefill_tokens": 1024,
    "max_input_tokens": 100,
    "pipeline_depth": 1,
    "waiting_served_ratio": 2.5,
    "max_prefill_padding": 0.5,
    "cuda_process_memory_fraction": 0.5,
    "max_prompt_prefix_length": 100,
    "compile": "1",
    "dtype": "float16",
    "deployment_framework": "tgis_native",
    "quantize": "gptq",
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 5,
    "cuda_graphs": "0",
    "cors_allow_origin": ("https://a.example", "https://b.example"),
}


def sample(s: Setting) -> Any:
    """A value of ``s`` that differs from every program's default."""
    if s.name in VALID_SAMPLES:
        return VALID_SAMPLES[s.name]
    if s.choices:
        return next(c for c in reversed(s.choices) if c not in {s.default_for(p) for p in Process})
    defaults = [d for d in (s.default_for(p) for p in Process) if d not in (None, UNSET)]
    base = defaults[0] if defaults else 0
    if s.kind is Kind.FLAG:
        return True
    if s.kind is Kind.BOOL:
        return not base
    if s.kind is Kind.INT:
        return int(max(base, s.minimum or 0)) + 7
    if s.kind is Kind.FLOAT:
        return float(base) + 1.5
    return f"sample-{s.name}"


def parse(process: Process, argv: list[str]) -> dict[str, Any]:
    """The values ``process``'s command line gives (nothing read from the environment)."""
    return dict(COMMANDS[process].make_context(process.value, argv).params)


@pytest.fixture(autouse=True)
def no_setting_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in SETTINGS:
        for name in s.env:
            monkeypatch.delenv(name, raising=False)


def test_a_setting_is_declared_once() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    twin = setting("other", ("--port",), ("OTHER",), Kind.INT, 1, "h", {R})
    with pytest.raises(ValueError, match="declared more than once: --port"):
        catalogue._check_declared_once((*SETTINGS, twin))
    alias = setting("other", ("--other",), ("MAX_TOTAL_TOKENS",), Kind.INT, 1, "h", {R})
    with pytest.raises(ValueError, match=r"declared more than once: \$MAX_TOTAL_TOKENS"):
        catalogue._check_declared_once((*SETTINGS, alias))


# Options that are no setting: the launcher's --dry-run, and -V / --version.
NOT_SETTINGS = frozenset({"dry_run", "version"})


@pytest.mark.parametrize("process", list(Process))
def test_each_program_has_exactly_the_options_of_the_settings_it_reads(process: Process) -> None:
    params = {p.name for p in COMMANDS[process].params} - NOT_SETTINGS
    assert params == {s.name for s in read_by(process)}
    for param in COMMANDS[process].params:
        if isinstance(param, click.Option) and param.name not in NOT_SETTINGS:
            s = catalogue.of(param.name or "")
            assert set(param.opts) | set(param.secondary_opts) == set(s.flags)
            assert param.envvar == list(s.env)


CONFIGS: dict[Process, tuple[type, frozenset[str]]] = {
    L: (LauncherConfig, frozenset()),
    R: (RouterConfig, router_cli._BUILT),
    S: (
        ShardConfig,
        frozenset(shard_cli._BUILT) | {f.name for f in dataclasses.fields(EngineSettings)},
    ),
}


@pytest.mark.parametrize("process", list(Process))
def test_each_setting_is_a_config_field_with_the_tables_default(process: Process) -> None:
    """A setting a program reads is a field of its configuration of the same name (with the
    table's default), or one its command line builds into another form."""
    config, built = CONFIGS[process]
    fields = {f.name: f for f in dataclasses.fields(config)}
    for s in read_by(process):
        if s.name in built:
            continue
        assert s.name in fields, s.name
        field = fields[s.name]
        expected = s.default_for(process)
        if expected is UNSET:
            assert field.default is dataclasses.MISSING
        else:
            assert field.default == expected, s.name
    engine = {f.name: f.default for f in dataclasses.fields(EngineSettings)}
    assert engine == {n: catalogue.default(n, S) for n in engine}


def launcher_values(process: Process, tmp_path: Path) -> dict[str, Any]:
    """What the launcher hands ``process`` for a default configuration."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    cfg = resolve(LauncherConfig(model_name=str(model)), {}, logging.getLogger("test"))
    if process is R:
        return router_values(cfg, model / "tokenizer.json")
    return shard_values(cfg)


@pytest.mark.parametrize("child", [R, S])
def test_the_launcher_hands_on_every_setting_a_child_reads(child: Process, tmp_path: Path) -> None:
    """Each setting the child reads is in the launcher's values for it, or comes to the
    child another way: its variable in the environment the child inherits."""
    values = launcher_values(child, tmp_path)
    for s in read_by(child):
        assert s.name in values or (s.env and not s.reads(L)), s.name


def forwarded(child: Process, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` through the launcher's forwarding and the child's command line (a secret
    through the child's environment)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, text in child_env(child, values).items():
            patch.setenv(name, text)
        argv = child_argv(child, values)
        if child is R and "tokenizer_path" not in values:
            argv += ["--tokenizer-path", "/t/tokenizer.json"]
        return parse(child, argv)


BUILDERS: dict[Process, Callable[[dict[str, Any]], Any]] = {
    R: router_cli.router_config,
    S: shard_cli.shard_config,
}

MiB = 1024 * 1024
# Settings a configuration holds in another form: the values they need beside them, and
# where the value is found.
BUILT_FORMS: dict[tuple[Process, str], tuple[dict[str, Any], Callable[[Any], Any]]] = {
    (R, "tls_cert_path"): ({"tls_key_path": "/k"}, lambda c: c.tls.cert_path),
    (R, "tls_key_path"): ({"tls_cert_path": "/c"}, lambda c: c.tls.key_path),
    (R, "tls_client_ca_cert_path"): (
        {"tls_cert_path": "/c", "tls_key_path": "/k"},
        lambda c: c.tls.client_ca_path,
    ),
    (R, "otlp_endpoint"): ({}, lambda c: c.tracing.endpoint),
    (R, "otlp_service_name"): (
        {"otlp_endpoint": "http://o:4317"},
        lambda c: c.tracing.service_name,
    ),
    (S, "disable_prefix_caching"): ({}, lambda c: not c.prefix_caching),
    (S, "prompt_cache_size_mb"): ({}, lambda c: c.prompt_cache_bytes // MiB),
    (S, "max_prompt_prefix_length"): ({}, lambda c: c.max_prefix_length),
}


def held(child: Process, config: Any, name: str) -> Any:
    """Where ``child``'s ``config`` holds setting ``name``'s value."""
    if (child, name) in BUILT_FORMS:
        return BUILT_FORMS[child, name][1](config)
    if isinstance(config, ShardConfig) and hasattr(config.engine, name):
        return getattr(config.engine, name)
    return getattr(config, name)


@pytest.mark.parametrize("child", [R, S])
def test_every_value_reaches_the_childs_configuration(child: Process) -> None:
    """For every setting a child reads: a non-default value, forwarded as the launcher
    forwards it, is what the child parses and what its configuration holds."""
    for s in read_by(child):
        value = sample(s)
        companions = BUILT_FORMS.get((child, s.name), ({}, None))[0]
        params = forwarded(child, {s.name: value, **companions})
        assert params[s.name] == value, s.name
        assert held(child, BUILDERS[child](params), s.name) == value, s.name


# Checked elsewhere: the model (resolved to its directory: test_launcher_commands.py) and
# TLS (real certificate files: test_launcher_commands.py::test_all_optional_arguments).
HANDED_ON_ELSEWHERE = frozenset(
    {"model_name", "tls_cert_path", "tls_key_path", "tls_client_ca_cert_path", "http_tls"}
)


@pytest.mark.parametrize("child", [R, S])
def test_the_launchers_own_values_are_what_it_hands_on(child: Process, tmp_path: Path) -> None:
    """For each setting both read: the launcher given a non-default value hands the child
    that value (speculation, LoRA and tracing settings in a context where they apply)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    context = {
        "model_name": str(model), "speculate": 2, "adapter_cache": str(tmp_path),
        "otlp_endpoint": "http://o:4317",
    }  # fmt: skip
    adapter = tmp_path / sample(catalogue.of("lora_adapters"))  # an adapter to load at start
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    for s in read_by(child):
        if not s.reads(L) or s.name in HANDED_ON_ELSEWHERE:
            continue
        value = str(tmp_path) if s.name == "adapter_cache" else sample(s)
        flags = LauncherConfig(**{**context, s.name: value})
        cfg = resolve(flags, {}, logging.getLogger("test"))
        given = router_values(cfg, model / "t.json") if child is R else shard_values(cfg)
        assert given[s.name] == value, s.name


def test_the_readme_documents_every_setting_a_user_sets() -> None:
    """Every flag of the launcher and every variable of a setting a user may set has its
    row in README.md's tables."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    for s in SETTINGS:
        if s.internal:
            continue
        names = [*s.env, *(f for f in s.flags if f.startswith("--") and s.reads(L))]
        for name in names:
            assert any(f"`{name}`" in row for row in rows), f"{s.name}: {name}"


@pytest.mark.parametrize(
    ("program", "argv"),
    [
        ("text-generation-launcher", ["-V"]),
        ("text-generation-launcher", ["--version"]),
        ("text-generation-router", ["-V"]),
        ("text-generation-router", ["--version"]),
        ("text-generation-server", ["-V"]),
        ("text-generation-server", ["--version"]),
    ],
)
def test_every_program_prints_its_version(program: str, argv: list[str]) -> None:
    """-V / --version, as TGI's programs have: the package's version, exit status 0, before
    anything else is looked at (no model, no shard)."""
    script = Path(sys.executable).parent / program
    result = subprocess.run(
        [str(script), *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{program} {tgis.__version__}\n"
