"""Stand-in for a shard or router process in the launcher tests (run as a script).

Usage: python fake_child.py DIR NAME [BEHAVIOUR ...] [-- ARGV ...]

At start it writes DIR/NAME.pid, and DIR/NAME.json with ARGV and its environment. Behaviours:
  ready               create DIR/NAME.ready
  health=PATH         serve ShardService.Health on the Unix socket PATH
  exit=SECONDS:CODE   exit with CODE after SECONDS
  signal=SECONDS:SIG  kill itself with signal number SIG after SECONDS
  ignore-term         ignore SIGTERM
  terms=N             exit 0 only at the Nth SIGTERM (each writes DIR/NAME.term<k>)
  term-signal=SIG     on SIGTERM, kill itself with signal number SIG instead of exiting
  grandchild          start `sleep 300` (in its process group), its pid in DIR/NAME.grandchild
  spam                first write 20000 lines to stdout and to stderr
On SIGTERM (unless ignored) it writes DIR/NAME.term (time.monotonic()) and exits 0.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path


def serve_health(path: str) -> object:
    from concurrent import futures

    import grpc

    from tgis.pb import shard_pb2, shard_pb2_grpc

    class Servicer(shard_pb2_grpc.ShardServiceServicer):
        def Health(self, request: object, context: object) -> object:
            return shard_pb2.HealthResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    shard_pb2_grpc.add_ShardServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def main() -> None:
    directory, name, *rest = sys.argv[1:]
    behaviours, argv = (
        (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    )
    out = Path(directory)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    (out / f"{name}.json").write_text(json.dumps({"argv": argv, "env": dict(os.environ)}))
    print(f"fake {name} started", flush=True)
    print(f"fake {name} says hello on stderr", file=sys.stderr, flush=True)

    terms_to_exit = next(
        (int(b.partition("=")[2]) for b in behaviours if b.startswith("terms=")), 1
    )
    terms = [0]
    term_signal = next(
        (int(b.partition("=")[2]) for b in behaviours if b.startswith("term-signal=")), 0
    )

    def on_term(_signum: int, _frame: object) -> None:
        terms[0] += 1
        (out / f"{name}.term{terms[0]}").write_text(repr(time.monotonic()))
        if terms[0] >= terms_to_exit:
            (out / f"{name}.term").write_text(repr(time.monotonic()))
            if term_signal:
                signal.signal(term_signal, signal.SIG_DFL)
                os.kill(os.getpid(), term_signal)
            os._exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if "ignore-term" in behaviours else on_term)
    deadline: tuple[float, str, int] | None = None
    keep = []
    for behaviour in behaviours:
        key, _, value = behaviour.partition("=")
        if key == "spam":
            for i in range(20000):
                print(f"stdout line {i}")
                print(f"stderr line {i}", file=sys.stderr)
            sys.stdout.flush()
        elif key == "grandchild":
            sleeper = subprocess.Popen(["sleep", "300"])
            (out / f"{name}.grandchild").write_text(str(sleeper.pid))
        elif key == "health":
            keep.append(serve_health(value))
        elif key == "ready":
            (out / f"{name}.ready").touch()
        elif key in ("exit", "signal"):
            seconds, code = value.split(":")
            deadline = (time.monotonic() + float(seconds), key, int(code))
    (out / f"{name}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.02)
        if deadline and time.monotonic() >= deadline[0]:
            if deadline[1] == "exit":
                os._exit(deadline[2])
            os.kill(os.getpid(), deadline[2])


if __name__ == "__main__":
    main()
