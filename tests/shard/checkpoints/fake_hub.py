"""A minimal stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's
``model_info``, ``snapshot_download`` and ``hf_hub_download`` (no network in the tests).

Serves ``GET /api/models/{repo}/revision/{rev}`` (repo info with siblings), ``GET
/api/models/{repo}/tree/{rev}`` (file listing) and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``
(file metadata headers and bytes). Unknown repos answer 404 with ``X-Error-Code: RepoNotFound``
as the Hub does. Every request path is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, bytes]


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add(self, repo_id: str, commit: str, directory: Path, extra: dict[str, bytes]) -> None:
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        files.update(extra)
        self.repos[repo_id] = FakeRepo(commit, files)

    def downloaded(self) -> list[str]:
        """File names fetched with GET .../resolve/... (sorted)."""
        return sorted(
            path.split("/resolve/", 1)[1].split("/", 1)[1]
            for method, path in self.requests
            if method == "GET" and "/resolve/" in path
        )

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _json(self, value: object, body: bool) -> None:
                data = json.dumps(value).encode()
                self._send(200, data, {"Content-Type": "application/json"}, body)

            def _not_found(self, code: str, body: bool) -> None:
                headers = {"X-Error-Code": code, "X-Error-Message": f"{code} (fake hub)"}
                self._send(404, b"{}", headers, body)

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                api = path.startswith("/api/models/")
                parts = path.removeprefix("/api/models/" if api else "/").split("/")
                repo = hub.repos.get("/".join(parts[:2]))
                if repo is None:
                    return self._not_found("RepoNotFound", body)
                if api and len(parts) == 2:
                    parts += ["revision", "main"]  # model_info without a revision
                if len(parts) < 4:
                    return self._not_found("EntryNotFound", body)
                kind, revision, rest = parts[2], parts[3], "/".join(parts[4:])
                if revision not in ("main", repo.commit):
                    return self._not_found("RevisionNotFound", body)
                if api and kind == "revision":
                    siblings = [{"rfilename": name} for name in repo.files]
                    return self._json(
                        {"id": "/".join(parts[:2]), "sha": repo.commit, "siblings": siblings}, body
                    )
                if api and kind == "tree":
                    entries = [
                        {
                            "type": "file",
                            "path": name,
                            "size": len(data),
                            "oid": hashlib.sha1(data).hexdigest(),
                        }
                        for name, data in repo.files.items()
                    ]
                    return self._json(entries, body)
                if not api and kind == "resolve" and rest in repo.files:
                    data = repo.files[rest]
                    headers = {
                        "X-Repo-Commit": repo.commit,
                        "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                        "Content-Type": "application/octet-stream",
                    }
                    return self._send(200, data, headers, body)
                return self._not_found("EntryNotFound", body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
