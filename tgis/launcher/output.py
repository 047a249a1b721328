"""Re-print children's output lines on the launcher's own stdout/stderr, labelled by source.

One reader thread per child stream reads until EOF, so a child never blocks on a full pipe.
Plain mode prefixes each line (`Shard 0: ...`); JSON mode keeps one JSON object per line,
adding a `source` field to children's JSON lines and wrapping other lines.
"""

from __future__ import annotations

import json
import threading
from typing import IO, TextIO

from tgis.launcher.logs import utc_timestamp


class OutputForwarder:
    """Copies lines from child pipes to the launcher's streams, one whole line at a time."""

    def __init__(self, json_output: bool = False) -> None:
        self.json_output = json_output
        self._lock = threading.Lock()

    def format_line(self, source: str, text: str) -> str:
        """The line as the launcher prints it."""
        if not self.json_output:
            return f"{source}: {text}"
        try:
            entry = json.loads(text)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            entry.setdefault("source", source)
        else:
            entry = {
                "timestamp": utc_timestamp(),
                "level": "INFO",
                "target": "text_generation_launcher",
                "source": source,
                "message": text,
            }
        return json.dumps(entry, ensure_ascii=False)

    def start(self, stream: IO[bytes], source: str, dest: TextIO) -> threading.Thread:
        """Start a daemon thread that forwards `stream` to `dest` until EOF."""
        thread = threading.Thread(
            target=self._pump, args=(stream, source, dest), name=f"output {source}", daemon=True
        )
        thread.start()
        return thread

    def _pump(self, stream: IO[bytes], source: str, dest: TextIO) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                line = self.format_line(source, text)
                with self._lock:
                    try:
                        dest.write(line + "\n")
                        dest.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone; keep draining the pipe
