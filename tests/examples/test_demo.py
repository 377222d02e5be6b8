"""The compose demo's two workers, run as plain processes against a producer process.

The same scripts the compose stack runs (examples/prefill_worker.py, examples/demo_decode.py),
started in the order compose gates them (the decode worker's ready file first), with a 1 s
lease so the whole run takes a few seconds. tests/compose runs them in containers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, ProducerProcess, wait_for

pytestmark = pytest.mark.timeout(120)
EXAMPLES = ROOT / "examples"


def demo_rows(output: str) -> dict[str, list[str]]:
    rows = {}
    for line in output.splitlines():
        words = line.split()
        if words and words[0] in ("on-time", "partial", "late", "queued") and len(words) >= 8:
            rows[words[0]] = words
    return rows


def test_demo_workers_decode_every_request_as_a_local_prefill_would(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    producer = producer_process(unbound_store_timeout_s=1, max_lease_s=600)
    ready = tmp_path / "ready"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KVPARK_", "DEMO_"))},
        "DEMO_TARGET": producer.target,
        "DEMO_READY_FILE": str(ready),
        "DEMO_QUEUE_EXTRA_S": "0.5",
        "DEMO_CHUNK_WAIT_S": "0.3",
        "OPENBLAS_NUM_THREADS": "1",
    }
    started = time.monotonic()
    decode = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "demo_decode.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_for(lambda: ready.exists() or decode.poll() is not None, 30, "the ready file")
        prefill = subprocess.run(
            [sys.executable, str(EXAMPLES / "prefill_worker.py")],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**env, "DEMO_EXIT_AFTER_PARK": "true"},
        )  # fmt: skip
        output, _ = decode.communicate(timeout=60)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait(timeout=10)
    took = time.monotonic() - started

    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    assert "parked partial" in prefill.stdout and ": 4 of 8 chunks" in prefill.stdout
    assert decode.returncode == 0, output
    rows = demo_rows(output)
    assert [rows[name][1:4] for name in ("on-time", "partial", "late", "queued")] == [
        ["remote", "-", "8/8"],
        ["partial", "WAIT_TIMEOUT", "4/8"],
        ["recompute", "REAPED", "0/4"],
        ["remote", "-", "6/6"],
    ], output
    # ... load time "ms", the computed chunks, then whether the tokens match.
    assert all(row[row.index("ms") + 2] == "yes" for row in rows.values()), output
    assert "tokens match a local prefill: 4 of 4" in output
    assert "is bitwise a local full prefill's" in output
    assert took < 30, f"the demo took {took:.1f}s"
