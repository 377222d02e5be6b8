"""Regenerates the committed Python stubs of `protos/kvpark/v1/kvpark.proto` into `shared/pb/`.

One command: `python scripts/protogen.py`. grpc's generator writes absolute imports
(`from kvpark.v1 import kvpark_pb2`) that only resolve when `protos/` output is on sys.path; we
rewrite that one line to a relative import so the stubs import cleanly from the installed
package (the well-known `_pb2_grpc` import trap). A test regenerates into a temporary folder and
compares, so stale stubs fail CI.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_FILE = "kvpark/v1/kvpark.proto"
OUT_DIR = ROOT / "shared" / "pb"
GENERATED = ("kvpark_pb2.py", "kvpark_pb2.pyi", "kvpark_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Runs protoc on the proto and returns {file name: text} of the three stubs."""
    from grpc_tools import protoc  # build-time dependency only

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO_FILE,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE}")
        texts = {}
        for name in GENERATED:
            text = (Path(tmp) / "kvpark" / "v1" / name).read_text()
            text = re.sub(r"^from kvpark\.v1 import ", "from . import ", text, flags=re.M)
            texts[name] = text
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    return texts


if __name__ == "__main__":
    generate(OUT_DIR)
    print(f"generated {', '.join(GENERATED)} into {OUT_DIR}", file=sys.stderr)
