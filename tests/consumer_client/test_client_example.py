"""The example decode worker runs against a real producer process and takes both paths."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import ROOT, ProducerProcess


def test_example_decode_worker_self_test(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    producer = producer_process()
    script = Path(ROOT) / "examples" / "decode_worker.py"
    run = subprocess.run(
        [sys.executable, str(script), "--target", producer.target, "--self-test",
         "--ids", "ex-1", "ex-2", "ex-missing", "--chunks", "4", "--chunk-bytes", "65536"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    log = run.stderr
    assert "ex-1: remote, 4 chunks loaded" in log
    assert "ex-2: remote, 4 chunks loaded" in log
    assert "ex-missing: recompute (TIMEOUT), 0 chunks loaded" in log
    assert "4 chunks recomputed" in log
