"""tgis.log: one JSON object per line from every logger, uncaught exceptions included, and
the fatal line in the termination log. Each case runs in a fresh interpreter (the set-up
replaces the root handler and the exception hooks of the whole process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run ``code`` in a new Python; its exit code and stderr lines."""
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TGIS_TERMINATION_LOG": str(tmp_path / "termination-log"),
        "LOG_LEVEL": "info",
        **(env or {}),
    }
    if "JSON_OUTPUT" not in (env or {}):
        full_env.pop("JSON_OUTPUT", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, result.stderr.splitlines()


def objects(lines: list[str]) -> list[dict[str, object]]:
    """Every line parsed; fails on a line that is not one JSON object."""
    parsed = []
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        parsed.append(entry)
    return parsed


def test_json_lines_from_every_logger_warnings_and_request_fields(tmp_path: Path) -> None:
    code, lines = run(
        """
        import logging, warnings
        from tgis.log import bind_log_fields, log_extra, setup_logging
        setup_logging(json_output=True, component="router")
        logging.getLogger("tgis.router.x").info("ours %d", 1)
        logging.getLogger("aiohttp.server").warning("third\\nparty")
        warnings.warn("deprecated thing")
        try:
            raise ValueError("bad\\nvalue")
        except ValueError:
            logging.getLogger("grpc._server").exception("handler failed")
        token = bind_log_fields(correlation_id="c-1")
        logging.getLogger("tgis.router.y").info("about the request")
        logging.getLogger("tgis.router.core.engine").info("engine", extra=log_extra(request_id=7))
        """,
        tmp_path,
    )
    assert code == 0, lines
    entries = objects(lines)
    assert len(entries) == 6, lines
    for entry in entries:
        assert {"timestamp", "level", "target", "message"} <= set(entry)
        assert str(entry["timestamp"]).endswith("Z")
    ours, third, warned, failed, bound, engine = entries
    assert (ours["target"], ours["level"], ours["message"]) == ("tgis.router.x", "INFO", "ours 1")
    assert (third["target"], third["message"]) == ("aiohttp.server", "third\nparty")
    assert warned["target"] == "py.warnings" and "deprecated thing" in str(warned["message"])
    assert failed["level"] == "ERROR" and failed["target"] == "grpc._server"
    assert "Traceback" in str(failed["exception"]) and "ValueError: bad" in str(failed["exception"])
    assert "correlation_id" not in ours
    assert bound["correlation_id"] == "c-1"
    assert engine["request_id"] == 7 and "correlation_id" not in engine


def test_uncaught_exception_is_one_json_object_and_one_termination_line(tmp_path: Path) -> None:
    code, lines = run(
        """
        import logging, threading
        from tgis.log import setup_logging
        setup_logging(json_output=True, component="shard")
        worker = threading.Thread(target=lambda: 1 / 0, name="worker")
        worker.start()
        worker.join()
        logging.getLogger("tgis").info("still running")
        raise RuntimeError("cannot start:\\nport in use")
        """,
        tmp_path,
    )
    assert code == 1
    thread, alive, fatal = objects(lines)
    assert thread["level"] == "ERROR" and "worker" in str(thread["message"])
    assert "ZeroDivisionError" in str(thread["exception"])
    assert alive["message"] == "still running"
    assert fatal["level"] == "CRITICAL"
    assert fatal["message"] == "uncaught exception: RuntimeError: cannot start: port in use"
    assert str(fatal["exception"]).startswith("Traceback")
    log = (tmp_path / "termination-log").read_text()
    assert log == "RuntimeError: cannot start: port in use\n"


def test_json_output_variable_and_fatal_start_up_line(tmp_path: Path) -> None:
    """The shard has no --json-output flag: the launcher sets JSON_OUTPUT for it."""
    code, lines = run(
        """
        import logging
        from tgis.log import setup_logging
        from tgis.termination import fail_startup
        setup_logging(json_output=False, component="shard")
        logging.getLogger("tgis.shard").info("loading")
        fail_startup("model not found:\\n/mnt/models")
        """,
        tmp_path,
        {"JSON_OUTPUT": "true"},
    )
    assert code == 1
    loading, fatal = objects(lines)
    assert loading["message"] == "loading"
    assert (fatal["level"], fatal["message"]) == ("ERROR", "model not found: /mnt/models")
    assert (tmp_path / "termination-log").read_text() == "model not found: /mnt/models\n"


def test_plain_lines_carry_the_request_fields(tmp_path: Path) -> None:
    code, lines = run(
        """
        import logging
        from tgis.log import bind_log_fields, setup_logging
        from tgis.termination import fail_startup
        setup_logging(json_output=False, component="router")
        bind_log_fields(correlation_id="abc")
        logging.getLogger("tgis.router.edge.servicer").info("Request generated 2 tokens")
        fail_startup("bad flag")
        """,
        tmp_path,
    )
    assert code == 1
    request, fatal = lines
    assert request.endswith(
        " INFO router tgis.router.edge.servicer: [correlation_id=abc] Request generated 2 tokens"
    )
    assert fatal == "error: bad flag"
