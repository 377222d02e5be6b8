"""`python -m benchmarks.callfloor` on a few loads: it completes, stops the server it started
and prints, for both ways a load's control could travel, per-load figures that come from the
calls it made. The values are not asserted (they depend on the machine's load)."""

from __future__ import annotations

import re
from typing import Any

import pytest

# The lab (benchmarks/), outside the wheel: run with -m slow.
pytestmark = pytest.mark.slow

ROW = re.compile(r"^(call|session)\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms$", re.M)


def test_callfloor_prints_both_ways_per_load(run_module: Any) -> None:
    proc = run_module("benchmarks.callfloor", ["--calls", "50", "--rounds", "2"], 120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {m[1]: [float(v) for v in m.groups()[1:]] for m in ROW.finditer(proc.stdout)}
    assert set(rows) == {"call", "session"}, proc.stdout
    for wall, client, server, both in rows.values():
        assert wall > 0 and client >= 0 and server >= 0
        assert both >= max(client, server)  # the median of the sums, not a sum of medians
    assert "medians of 2 rounds of 50" in proc.stdout


@pytest.mark.parametrize("args", [["--calls", "0"], ["--rounds", "0"]])
def test_callfloor_refuses_an_empty_measurement(run_module: Any, args: list[str]) -> None:
    proc = run_module("benchmarks.callfloor", args, 60)
    assert proc.returncode == 2 and "at least 1" in proc.stderr
