"""The tokenizer.json handed to the router: the model's own, or one converted by transformers.

The router only reads fast-tokenizer files. When the model directory has none, transformers
(in a subprocess, offline, so the launcher never imports it) converts the slow tokenizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tgis.launcher.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"
CONVERSION_TIMEOUT_S = 300.0

_CONVERT_SCRIPT = (
    "import sys\n"
    "from transformers import AutoTokenizer\n"
    "tokenizer = AutoTokenizer.from_pretrained(\n"
    "    sys.argv[1], local_files_only=True, trust_remote_code=sys.argv[3] == 'trust'\n"
    ")\n"
    "tokenizer.save_pretrained(sys.argv[2])\n"
)


@dataclass(frozen=True)
class TokenizerFile:
    """Path of the tokenizer.json; `temp_dir` is set when the launcher created it (to clean up)."""

    path: Path
    temp_dir: Path | None = None

    def cleanup(self) -> None:
        """Remove the converted tokenizer's temporary directory, if any."""
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def convert_tokenizer(
    model_dir: Path, out_dir: Path, timeout: float, trust_remote_code: bool = False
) -> str | None:
    """Run the conversion in a subprocess (``trust_remote_code``: the model repository's
    tokenizer code may run, ``--trust-remote-code``); None on success, else a short reason."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    trust = "trust" if trust_remote_code else "no"
    try:
        result = subprocess.run(
            [sys.executable, "-c", _CONVERT_SCRIPT, str(model_dir), str(out_dir), trust],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:g} s"
    except OSError as e:
        return str(e)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit status {result.returncode}"
    return None


def prepare_tokenizer(
    model_dir: Path,
    log: logging.Logger,
    timeout: float = CONVERSION_TIMEOUT_S,
    trust_remote_code: bool = False,
) -> TokenizerFile:
    """`<model_dir>/tokenizer.json` if present, else a converted one; ConfigError if neither."""
    existing = model_dir / TOKENIZER_FILE
    if existing.is_file():
        return TokenizerFile(existing)
    log.info("No %s in %s, converting the tokenizer with transformers", TOKENIZER_FILE, model_dir)
    out_dir = Path(tempfile.mkdtemp(prefix="tgis-tokenizer-"))
    reason = convert_tokenizer(model_dir, out_dir, timeout, trust_remote_code)
    converted = out_dir / TOKENIZER_FILE
    if reason is None and converted.is_file():
        log.info("Converted tokenizer written to %s", converted)
        return TokenizerFile(converted, out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    log.warning("Failed to convert tokenizer: %s", reason or "no fast tokenizer produced")
    raise ConfigError("No existing fast tokenizer (tokenizer.json) found")
