"""Generate the Python gRPC stubs for protos/*.proto into tgis/pb/.

Run by `make install` and by the setuptools build (setup.py), never committed.
protoc emits `import x_pb2` in the *_grpc.py files; those are rewritten to
package-relative imports so the stubs live inside `tgis.pb`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "tgis" / "pb"


def generate(proto_dir: Path = PROTO_DIR, out_dir: Path = OUT_DIR) -> list[Path]:
    """Compile every .proto in proto_dir into out_dir; return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency only

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(proto_dir.glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        fixed = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in generate():
        print(written_path.relative_to(ROOT), file=sys.stderr)
