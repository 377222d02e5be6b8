"""Runs the benchmark's commands as a user would: `python -m <module> ...` in a subprocess from
the project root (each starts and stops its own helper processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

Finished = subprocess.CompletedProcess[str]


def _run(module: str, args: Sequence[str], timeout: float) -> Finished:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def run_module() -> Callable[[str, Sequence[str], float], Finished]:
    """`run_module(module, args, timeout)`: the finished process, whatever its exit status."""
    return _run


@pytest.fixture
def run_json(tmp_path: Path) -> Callable[[str, Sequence[str], float], tuple[Finished, Any]]:
    """`run_json(module, args, timeout)`: runs it with `--json PATH`, asserts exit 0, and
    returns the finished process and the JSON document it wrote."""

    def run(module: str, args: Sequence[str], timeout: float) -> tuple[Finished, Any]:
        out = tmp_path / f"{module}.json"
        proc = _run(module, [*args, "--json", str(out)], timeout)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        return proc, json.loads(out.read_text())

    return run
