"""Find and fetch a model's weights: a local directory, the local HF cache, or the Hub.

Backs ``text-generation-server download-weights`` and finds the directory that
``convert-to-safetensors`` works on. Downloads go through ``huggingface_hub`` into the same
cache the shard later reads offline (``tgis.model_files.hf_hub_cache``). Nothing here
converts or imports torch: ``download_weights`` says when ``.bin`` weights are left to
convert, and the ``download-weights`` command converts them (``convert.py``).

The file selection follows TGIS (``weight_files.py``): the weight files with the requested
extension(s) at the top level of the repository, plus the configuration, tokenizer and
generation files (``.json .py .model .md``, ``merges.txt``, ``vocab.txt``) and the weight
index. When ``.safetensors`` are wanted but the model only has PyTorch ``.bin`` pickles,
those are fetched and, with auto-convert, left to convert to safetensors next to them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis.model_files import hf_hub_cache
from tgis.shard.checkpoints.weight_files import (
    META_EXTENSIONS,
    PYTORCH,
    SAFETENSORS,
    WeightsError,
    complete_weight_files,
    index_file_name,
    is_meta_file,
    is_weight_file,
    local_weight_files,
    missing_indexed_files,
)

_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}

Report = Callable[[str], None]


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (1/on/yes/true, any case)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE_VALUES


def parse_extensions(extension: str) -> list[str]:
    """``".safetensors"`` or ``"safetensors,.bin"`` → ``[".safetensors", ".bin"]``."""
    extensions: list[str] = []
    for part in extension.split(","):
        part = part.strip()
        if not part:
            continue
        part = part if part.startswith(".") else "." + part
        if part not in extensions:
            extensions.append(part)
    if not extensions:
        raise WeightsError("--extension must name at least one file extension, e.g. .safetensors")
    return extensions


def cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` in the local cache, if any."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    if isinstance(config, str):
        return Path(config).parent
    # No config.json cached (or its absence cached): find the snapshot through refs/.
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    ref = revision or "main"
    ref_file = repo_dir / "refs" / ref
    commit = ref_file.read_text(encoding="utf-8").strip() if ref_file.is_file() else ref
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _describe(model: str, revision: str | None) -> str:
    return f"model '{model}'" + (f" (revision '{revision}')" if revision else "")


def _check_repo_id(model_name: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model_name)
    except HFValidationError:
        raise WeightsError(
            f"'{model_name}' is neither a local directory nor a valid Hugging Face model id"
        ) from None


def resolve_existing_model_dir(model_name: str, revision: str | None = None) -> Path:
    """A local directory as is, else the model's snapshot in the local HF cache (no download)."""
    if not model_name:
        raise WeightsError("a model name or directory is required")
    as_path = Path(model_name).expanduser()
    if as_path.is_dir():
        return as_path.resolve()
    _check_repo_id(model_name)
    cache = hf_hub_cache()
    snapshot = cached_snapshot(model_name, revision, cache)
    if snapshot is None:
        raise WeightsError(
            f"{_describe(model_name, revision)} not found: not a local directory and not in the "
            f"local Hugging Face cache ({cache}); run `text-generation-server download-weights "
            f"{model_name}` first"
        )
    return snapshot


def _counted(files: Iterable[Path], extension: str) -> str:
    count = len(list(files))
    return f"{count} {extension} file" + ("" if count == 1 else "s")


def _cached_weights(directory: Path, weight_exts: list[str]) -> dict[str, list[Path]] | None:
    """Every requested extension's complete file set, or None if one is missing."""
    found = {ext: complete_weight_files(directory, ext) for ext in weight_exts}
    return found if all(found.values()) else None


def _present(directory: Path, weight_exts: list[str], where: str, report: Report) -> bool:
    """Report and return True when every requested weight extension is complete here."""
    found = _cached_weights(directory, weight_exts)
    if found is None:
        return False
    listed = ", ".join(_counted(files, ext) for ext, files in found.items())
    report(f"Weights already present in {where}: {directory} ({listed})")
    return True


def _convertible(directory: Path, weight_exts: list[str]) -> bool:
    """Only the .safetensors are missing, and a complete set of .bin weights is here."""
    others = [e for e in weight_exts if e != SAFETENSORS]
    return (
        SAFETENSORS in weight_exts
        and (not others or _cached_weights(directory, others) is not None)
        and not local_weight_files(directory, SAFETENSORS)
        and bool(complete_weight_files(directory, PYTORCH))
    )


def _not_found_reason(directory: Path, weight_exts: list[str]) -> str:
    """Why ``directory`` lacks the weights: none at all, or an index naming missing files."""
    for ext in weight_exts:
        missing = missing_indexed_files(directory, ext)
        if missing and local_weight_files(directory, ext):
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            return (
                f"the {ext} weights in {directory} are incomplete, missing "
                f"{', '.join(missing[:3])}{more}"
            )
    return f"no {' or '.join(weight_exts)} weights found in {directory}"


@dataclass(frozen=True)
class FetchedWeights:
    """Where ``download_weights`` left a model's weights, and what its caller still does."""

    directory: Path
    # Where only PyTorch .bin weights were found ("the directory", "the local cache", "the
    # Hub") when .safetensors were asked for with auto-convert: the caller converts
    # ``directory`` (``convert.convert_directory``). None: nothing to convert.
    unconverted_in: str | None = None
    # The model, described, when it was downloaded from the Hub: the caller reports where
    # its weights are once they are ready.
    downloaded: str | None = None


@dataclass(frozen=True)
class _Wanted:
    """What ``download_weights`` was asked for."""

    model_name: str
    revision: str | None
    token: str | None
    weight_exts: list[str]
    auto_convert: bool
    report: Report

    @property
    def described(self) -> str:
        return _describe(self.model_name, self.revision)


def _to_convert(
    directory: Path, wanted: _Wanted, where: str, downloaded: str | None = None
) -> FetchedWeights:
    """``directory``'s .bin weights left for the caller to convert; WeightsError without
    auto-convert."""
    if not wanted.auto_convert:
        raise WeightsError(
            f"{directory} has only PyTorch .bin weights, no .safetensors: rerun with "
            "--auto-convert (the default) or run convert-to-safetensors"
        )
    return FetchedWeights(directory, unconverted_in=where, downloaded=downloaded)


def download_weights(
    model_name: str,
    *,
    revision: str | None = None,
    extension: str = SAFETENSORS,
    auto_convert: bool = True,
    token: str | None = None,
    report: Report = print,
) -> FetchedWeights:
    """Make the model's weights available locally: the directory holding them, and whether
    its .bin weights still need converting (the caller's step, with auto-convert).

    A local directory is used in place. A model id is looked up in the local HF cache
    first; when its weights are missing there it is downloaded, unless ``HF_HUB_OFFLINE``
    is set. Raises WeightsError with a one-line reason.
    """
    if not model_name:
        raise WeightsError("a model name or directory is required")
    extensions = parse_extensions(extension)
    weight_exts = [e for e in extensions if e not in META_EXTENSIONS]
    wanted = _Wanted(model_name, revision, token, weight_exts, auto_convert, report)
    as_path = Path(model_name).expanduser()
    if as_path.is_dir():
        return _local_directory(as_path.resolve(), wanted)
    _check_repo_id(model_name)
    cache = hf_hub_cache()
    snapshot = cached_snapshot(model_name, revision, cache)
    if snapshot is not None and _present(snapshot, weight_exts, "the local cache", report):
        return FetchedWeights(snapshot)
    cached_bins = snapshot if snapshot is not None and _convertible(snapshot, weight_exts) else None
    if hub_offline():
        return _offline(wanted, snapshot, cached_bins, cache)
    return _from_hub(wanted, cached_bins, cache)


def _local_directory(directory: Path, wanted: _Wanted) -> FetchedWeights:
    """A local directory's weights: present, or .bin weights to convert in place."""
    if _present(directory, wanted.weight_exts, "the directory", wanted.report):
        return FetchedWeights(directory)
    if _convertible(directory, wanted.weight_exts):
        return _to_convert(directory, wanted, "the directory")
    raise WeightsError(_not_found_reason(directory, wanted.weight_exts))


def _offline(
    wanted: _Wanted, snapshot: Path | None, cached_bins: Path | None, cache: Path
) -> FetchedWeights:
    """With ``HF_HUB_OFFLINE``: the cached .bin weights to convert, else WeightsError."""
    if cached_bins is not None:
        return _to_convert(cached_bins, wanted, "the local cache")
    if snapshot is None:
        raise WeightsError(
            f"{wanted.described} is not in the local Hugging Face cache ({cache}) and "
            "HF_HUB_OFFLINE is set, so it cannot be downloaded"
        )
    raise WeightsError(
        f"{wanted.described} in the local Hugging Face cache: "
        f"{_not_found_reason(snapshot, wanted.weight_exts)}, and HF_HUB_OFFLINE is set, so "
        "they cannot be downloaded"
    )


def _from_hub(wanted: _Wanted, cached_bins: Path | None, cache: Path) -> FetchedWeights:
    """Download the model's files from the Hub into ``cache``; when the Hub cannot list
    them, the cached .bin weights (with auto-convert) rather than nothing."""
    name, revision, described = wanted.model_name, wanted.revision, wanted.described
    try:
        repo_files = _list_repo_files(name, revision, wanted.token)
    except Exception as e:
        error = _hub_error(e, name, revision)
        if cached_bins is not None and wanted.auto_convert:
            wanted.report(f"warning: {error}; using the cached .bin weights")
            return _to_convert(cached_bins, wanted, "the local cache")
        raise error from None
    files, convert = _select_files(repo_files, wanted.weight_exts, wanted.auto_convert, described)
    wanted.report(f"Downloading {len(files)} files of {described} into {cache}")
    try:
        directory = Path(_snapshot_download(name, revision, wanted.token, files, cache))
    except Exception as e:
        raise _hub_error(e, name, revision) from None
    downloaded = [*wanted.weight_exts, PYTORCH] if convert else wanted.weight_exts
    incomplete = [e for e in downloaded if missing_indexed_files(directory, e)]
    if incomplete:
        raise WeightsError(
            f"{described} downloaded incompletely: {_not_found_reason(directory, incomplete)}"
        )
    if not convert:
        return FetchedWeights(directory, downloaded=described)
    if local_weight_files(directory, SAFETENSORS):
        raise WeightsError(
            f"{directory} already has some .safetensors files but not a complete set; "
            "remove them and run download-weights again to re-convert"
        )
    return _to_convert(directory, wanted, "the Hub", downloaded=described)


def _select_files(
    repo_files: list[str], weight_exts: list[str], auto_convert: bool, described: str
) -> tuple[list[str], bool]:
    """The repository files to fetch, and whether .bin weights must be converted after."""
    wanted = [f for f in repo_files if any(is_weight_file(f, e) for e in weight_exts)]
    exts = list(weight_exts)
    convert = False
    if SAFETENSORS in weight_exts and not any(is_weight_file(f, SAFETENSORS) for f in repo_files):
        bins = [f for f in repo_files if is_weight_file(f, PYTORCH)]
        if bins:
            if not auto_convert:
                raise WeightsError(
                    f"{described} has no .safetensors weights on the Hugging Face Hub, only "
                    "PyTorch .bin: rerun with --auto-convert (the default) or --extension .bin"
                )
            wanted += [f for f in bins if f not in wanted]
            exts.append(PYTORCH)
            convert = True
    if weight_exts and not wanted:
        raise WeightsError(
            f"no {' or '.join(weight_exts)} weights found for {described} on the Hugging Face Hub"
        )
    extra = [
        f
        for f in repo_files
        if f not in wanted and (is_meta_file(f) or any(index_file_name(f, e) for e in exts))
    ]
    return wanted + extra, convert


def _list_repo_files(model_name: str, revision: str | None, token: str | None) -> list[str]:
    """The repository's file names (one request, as TGIS does; no retry loop)."""
    from huggingface_hub import HfApi

    info = HfApi(token=token).model_info(model_name, revision=revision, expand=["siblings"])
    return [s.rfilename for s in info.siblings or []]


def _snapshot_download(
    model_name: str, revision: str | None, token: str | None, files: list[str], cache: Path
) -> str:
    from huggingface_hub import snapshot_download

    # Exact names as patterns: only what _select_files chose (fnmatch-escaped).
    patterns = [_escape_pattern(f) for f in files]
    result: Any = snapshot_download(
        model_name, revision=revision, cache_dir=cache, allow_patterns=patterns, token=token
    )
    return str(result)


def _escape_pattern(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _hub_error(error: Exception, model_name: str, revision: str | None) -> WeightsError:
    """A one-line WeightsError for anything huggingface_hub or the network raised."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    described = _describe(model_name, revision)
    if isinstance(error, GatedRepoError):
        message = (
            f"access to {described} is gated on the Hugging Face Hub: accept its terms and "
            "pass --token or set HF_TOKEN"
        )
    elif isinstance(error, RevisionNotFoundError):
        message = f"revision '{revision}' of model '{model_name}' not found on the Hugging Face Hub"
    elif isinstance(error, RepositoryNotFoundError):
        message = (
            f"model '{model_name}' not found on the Hugging Face Hub (a private model needs "
            "--token or HF_TOKEN)"
        )
    else:
        detail = " ".join(str(error).split())
        if len(detail) > 300:
            detail = detail[:297] + "..."
        message = (
            f"cannot download {described} from the Hugging Face Hub ({constants.ENDPOINT}): "
            f"{type(error).__name__}" + (f": {detail}" if detail else "")
        )
    return WeightsError(message)
