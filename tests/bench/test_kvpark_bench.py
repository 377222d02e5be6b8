"""`kvpark bench`, the operator benchmark in the wheel, run as an operator runs it: the installed
command in a subprocess. By default it starts, measures and stops a producer of its own; with
--target it measures a running producer and leaves it running. The JSON is checked for what
the command promises (every byte verified, a row per transport the producer offers, positive
throughputs and ratios, the latency rows, each target met, missed or not measured),
never for how fast this machine is. Each run is bounded by its subprocess timeout.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import ProducerProcess

MB = 1_000_000


def kvpark(*argv: str, timeout: float, env: dict[str, str] | None = None) -> Any:
    script = Path(sys.executable).parent / "kvpark"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvpark.client"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [*command, *argv], capture_output=True, text=True, timeout=timeout,
        env={**clean, **(env or {})},
    )  # fmt: skip


def check_document(
    doc: dict[str, Any], chunks: list[int], reps: int, tries: int, transports: list[str]
) -> None:
    assert doc["ok"] is True and doc["failures"] == [], doc["failures"]
    assert doc["plan"]["transports"] == transports
    size = doc["plan"]["size_bytes"]
    concurrent = size >= 16 * chunks[0]  # 16 loads of whole chunks at once, when they fit
    # raw TCP and each transport's fetch of every repetition, the concurrent loads, and the
    # warm-up's 4 KiB per transport: all compared byte for byte
    verified = size * reps * len(chunks) * (1 + len(transports)) + 4096 * len(transports)
    # per repetition, one load of the whole transfer, then the concurrent loads twice: alone,
    # and with late fetches; and once for all transports, raw TCP's one transfer and its
    # transfers at once
    per_rep = 3 * len(transports) + 2
    assert doc["verified_bytes"] == verified + per_rep * concurrent * size * reps
    rows = {(r["kind"], r["transport"], r["chunk_bytes"]): r for r in doc["transfer"]}
    expected = {("raw_tcp", None, c) for c in chunks}
    expected |= {("park", t, c) for t in transports if t != "tcp" for c in chunks}
    expected |= {("fetch", t, c) for t in transports for c in chunks}
    expected |= {
        (kind, t, chunks[0])
        for kind in ("fetch_one", "fetch_concurrent", "fetch_concurrent_probed")
        for t in transports
        if concurrent
    }
    expected |= {(k, None, chunks[0]) for k in ("raw_tcp_one", "raw_tcp_concurrent") if concurrent}
    assert rows.keys() == expected
    for row in rows.values():
        assert len(row["seconds"]) == reps and row["gbps"] > 0, row
        assert 0 < row["ratio_to_raw_tcp"] < math.inf, row
        assert row["cpu_s_per_gb"]["this"] > 0, row
        if row["kind"].startswith(("fetch_concurrent", "raw_tcp_concurrent")):
            assert 0 < row["ratio_to_single"] < math.inf, row
        else:
            assert "ratio_to_single" not in row, row
    latency = {(r["kind"], r["transport"]): r for r in doc["latency"]}
    busy = {("late_fetch_busy", t) for t in transports if concurrent}
    assert latency.keys() == {(k, t) for k in ("lookup", "late_fetch") for t in transports} | busy
    for (kind, _), row in latency.items():
        assert row["n"] == tries if kind != "late_fetch_busy" else row["n"] >= reps, row
        assert 0 < row["p50_us"] <= row["p99_us"], row
        if kind == "late_fetch":  # the idle late fetch, against the Lookup just before it
            assert 0 < row["p50_ratio_to_lookup"] < math.inf, row
        else:
            assert "p50_ratio_to_lookup" not in row, row
    targets = {t["name"]: t for t in doc["targets"]}
    assert (targets["fetch over tcp"]["met"] is None) == ("tcp" not in transports)
    assert (targets["park over grpc"]["measured"] is None) == ("grpc" not in transports)
    for target in targets.values():
        assert target["met"] in (True, False, None), target
        assert (target["verdict"] == "not measured") == (target["measured"] is None), target
        judged = target["verdict"] in ("met", "missed")
        assert (target["met"] is not None) == judged, target
    # A p99 is judged on 100 samples or more; a quick run's late fetches may be fewer.
    late = targets["late fetch during them, p99"]
    if late["n"] is not None:
        assert (late["verdict"] == "too few samples") == (late["n"] < 100), late


def test_quick_run_with_its_own_producer(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = kvpark("bench", "--quick", "--json", "--json-file", str(out), timeout=90)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    check_document(doc, [2**20], reps=2, tries=200, transports=["grpc", "tcp", "shm"])
    assert doc["plan"]["quick"] is True and doc["elapsed_s"] < 30
    # Both processes' CPU is read when the producer is ours. It is counted in clock ticks
    # (10 ms): the producer's part of a quick 64 MB shm fetch (one ~15 ms copy) can read 0.
    for row in doc["transfer"]:
        assert row["cpu_s_per_gb"]["other"] >= 0 and row["cpu_s_per_gb"]["total"] > 0, row
    assert sum(row["cpu_s_per_gb"]["other"] for row in doc["transfer"]) > 0
    producer = doc["producer"]
    assert producer["own"] is True and producer["version"]
    assert doc["versions"]["crc32c"].startswith("crc32c-rs ")
    assert not Path(f"/proc/{producer['pid']}").exists()  # stopped at the end
    assert "starting our own producer" in proc.stderr and "latency" in proc.stderr


def test_target_measures_a_running_producer_and_leaves_it_running(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    producer = producer_process(park_token="park-secret", fetch_token="fetch-secret")
    park_file = tmp_path / "park"
    park_file.write_text("park-secret\n")
    args = ["bench", "--target", producer.target, "--park-token-file", str(park_file),
            "--size", "8MB", "--chunk", "1MiB,2MiB", "--reps", "2",
            "--latency-tries", "20"]  # fmt: skip
    fetch_env = {"KVPARK_FETCH_TOKEN": "fetch-secret"}
    proc = kvpark(*args, "--json", "--quiet", timeout=60, env=fetch_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    # This producer offers neither a data listener nor a shared-memory socket: gRPC alone.
    check_document(doc, [2**20, 2**21], reps=2, tries=20, transports=["grpc"])
    assert doc["producer"] == {"own": False, "target": producer.target, "pid": None,
                               "version": doc["producer"]["version"]}  # fmt: skip
    for row in doc["transfer"]:  # the producer's CPU time is not ours to read; the peer's is
        assert (row["cpu_s_per_gb"]["other"] is None) == (row["kind"] != "raw_tcp"), row
    assert not any(row["kind"].startswith("raw_tcp_") for row in doc["transfer"])  # 8 chunks
    assert proc.stderr == "" and producer.proc.poll() is None

    # A refused token is a section that could not run: exit 1, the reason in the report.
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-park-token")
    failed = kvpark(*args[:3], "--park-token-file", str(wrong), *args[5:], "--quiet",
                    timeout=60, env=fetch_env)  # fmt: skip
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "FAILED: warm-up: AuthError" in failed.stdout
    # More than the producer takes in one batch (half its 64 MiB pool): a usage error.
    too_big = kvpark(*args[:5], "--size", "40MB", "--quiet", timeout=60, env=fetch_env)
    assert too_big.returncode == 2 and "lower --size" in too_big.stderr
    assert producer.proc.poll() is None


def test_usage_errors_exit_2() -> None:
    for argv, said in (
        (["--size", "0"], "expected a size"),
        (["--chunk", "1MiB,lots"], "expected a size"),
        (["--reps", "0"], "expected a count"),
        (["--transport", "carrier-pigeon"], "invalid choice"),
        (["--tls"], "go with --target"),
    ):
        proc = kvpark("bench", *argv, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, (argv, proc.stderr)
